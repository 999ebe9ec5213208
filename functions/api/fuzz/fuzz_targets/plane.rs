//! `parse_plane` on arbitrary bodies (both payload versions), signed correctly unless the first byte says otherwise.
#![no_main]

use aws_lc_rs::hmac;
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

const SECRET: &[u8] = b"fuzz-secret-0123456789";

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let mut headers = HeaderMap::new();
    let signature = if selector & 1 == 0 {
        hex::encode(hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, SECRET), body).as_ref())
    } else {
        hex::encode(&body[..body.len().min(32)])
    };
    if let Ok(v) = HeaderValue::from_str(&signature) {
        headers.insert("x-plane-signature", v);
    }
    if selector & 2 == 0 {
        headers.insert(
            "x-plane-delivery",
            HeaderValue::from_static("11111111-2222-4333-8444-555555555555"),
        );
    }
    if loams_api::webhooks::parse_plane(&headers, body, SECRET).is_ok() {
        assert_eq!(selector & 1, 0, "only a correctly signed body may parse");
    }
});
