//! `parse_zulip` on arbitrary bodies. Inputs that are JSON objects get the bot's token spliced in first (when the
//! first byte says so), so the checks after authentication are reached too.
#![no_main]

use libfuzzer_sys::fuzz_target;

const TOKEN: &str = "fuzz-token-0123456789abcdef";

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let mut body = body.to_vec();
    if selector & 1 == 0 && body.first() == Some(&b'{') {
        body.splice(1..1, format!("\"token\":\"{TOKEN}\",").into_bytes());
    }
    if let Ok(event) = loams_api::webhooks::parse_zulip(&body, TOKEN) {
        assert!(!event.trigger.is_empty());
        assert!(event.channel.is_some() == event.topic.is_some());
    }
});
