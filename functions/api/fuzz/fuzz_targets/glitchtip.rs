//! `parse_glitchtip` on arbitrary bodies: a parsed alert always names a numeric issue on the configured origin.
#![no_main]

use libfuzzer_sys::fuzz_target;

const ORIGIN: &str = "https://gt.example";

fuzz_target!(|data: &[u8]| {
    if let Ok(signal) = loams_api::webhooks::parse_glitchtip(data, ORIGIN) {
        let id = signal.glitchtip_issue_id.unwrap_or_default();
        assert!(!id.is_empty() && id.bytes().all(|c| c.is_ascii_digit()));
        assert!(signal.link.to_ascii_lowercase().starts_with(ORIGIN));
    }
});
