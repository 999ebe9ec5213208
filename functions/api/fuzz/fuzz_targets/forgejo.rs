//! `parse_forgejo` on arbitrary bodies. The first byte picks the event header and whether the body is signed
//! correctly (so most inputs reach the payload parsers) or with the input's own bytes as the signature.
#![no_main]

use aws_lc_rs::hmac;
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

const SECRET: &[u8] = b"fuzz-secret-0123456789";

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let event = ["pull_request", "push", "issues", "create"][usize::from(selector & 3)];
    let mut headers = HeaderMap::new();
    headers.insert("x-forgejo-event", HeaderValue::from_static(event));
    let signature = if selector & 4 == 0 {
        hex::encode(hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, SECRET), body).as_ref())
    } else {
        hex::encode(&body[..body.len().min(32)])
    };
    if let Ok(v) = HeaderValue::from_str(&signature) {
        let name = if selector & 8 == 0 {
            "x-forgejo-signature"
        } else {
            "x-gitea-signature"
        };
        headers.insert(name, v);
    }
    if let Ok(parsed) = loams_api::webhooks::parse_forgejo(&headers, body, SECRET) {
        // Only a correctly signed body may ever parse.
        assert_eq!(selector & 4, 0);
        if let Some(loams_api::webhooks::ForgejoEvent::PullRequest(pr)) = parsed.event {
            assert!(pr.merged_factory_run.is_none() || (pr.merged && pr.action == "closed"));
        }
    }
});
