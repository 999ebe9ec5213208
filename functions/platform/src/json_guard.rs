//! A check for JSON from outside the process, run before serde_json parses it into a `Value`.
//!
//! serde_json's `raw_value` feature is on in every build here (axum's `json` feature and lambda_http ask for it,
//! and Cargo turns a feature on for the whole build). With it, parsing a `Value` reads an object whose first key is
//! `$serde_json::private::RawValue` by parsing that key's string as JSON again, with a nesting limit of its own.
//! Nested inside itself, that lets a body well under a megabyte reach tens of thousands of levels, and the parse
//! overflows the stack, which aborts the whole process. No client means to send serde_json's private keys, so a body
//! that holds one is refused before it is parsed. Only keys count: a value that merely starts the same way (a pull
//! request title, say) is data, and refusing it would let anyone suppress a delivery. Answers from configured peers
//! (the agents the worker calls, the apps the agents call, the server the phones call) are not checked: the
//! deployment trusts them already.

/// What every private key of serde_json starts with.
const PRIVATE_PREFIX: &[u8] = b"$serde_json::private::";

/// Whether an object key in `json` (a string followed by `:`, escapes decoded) starts with serde_json's private
/// prefix. Reads the bytes once, without recursion, whatever `json` holds.
pub fn has_serde_private_key(json: &[u8]) -> bool {
    let mut i = 0;
    while i < json.len() {
        if json[i] != b'"' {
            i += 1;
            continue;
        }
        i += 1;
        // How much of the prefix the string has matched so far; `None` once it differs.
        let mut matched = Some(0);
        while i < json.len() && json[i] != b'"' {
            let (byte, len) = if json[i] == b'\\' {
                unescape(&json[i..])
            } else {
                (Some(json[i]), 1)
            };
            matched = match matched {
                Some(n) if n < PRIVATE_PREFIX.len() => {
                    (byte == Some(PRIVATE_PREFIX[n])).then_some(n + 1)
                }
                other => other,
            };
            i += len;
        }
        i += 1;
        if matched == Some(PRIVATE_PREFIX.len()) && is_key(&json[i.min(json.len())..]) {
            return true;
        }
    }
    false
}

/// Whether the bytes after a string make it an object key: JSON whitespace, then `:`.
fn is_key(after: &[u8]) -> bool {
    after
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .is_some_and(|&b| b == b':')
}

/// The escape at the start of `s` (which starts with a backslash): the ASCII byte it stands for (`None` for
/// anything else, or a malformed escape) and how many bytes it takes.
fn unescape(s: &[u8]) -> (Option<u8>, usize) {
    match s.get(1) {
        Some(b'u') => {
            let code = s
                .get(2..6)
                .and_then(|hex| std::str::from_utf8(hex).ok())
                .and_then(|hex| u32::from_str_radix(hex, 16).ok());
            let byte = code.and_then(|c| u8::try_from(c).ok()).filter(u8::is_ascii);
            (byte, s.len().min(6))
        }
        Some(&c) => (Some(c), 2),
        None => (None, 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_private_keys_however_they_are_written() {
        for json in [
            r#"{"$serde_json::private::RawValue":"1"}"#,
            r#"{"a":[{"b":{"$serde_json::private::Number":"1"}}]}"#,
            r#"{"\u0024serde_json::private::RawValue":"1"}"#,
            r#"{"$serde\u005fjson\u003a:private::RawValue":"1"}"#,
            "{\"$serde_json::private::RawValue\" \n\t : \"1\"}",
            // An escaped quote or backslash does not end the string before it.
            r#"{"a\"":{"$serde_json::private::RawValue":"1"}}"#,
            r#"{"a\\":0,"$serde_json::private::RawValue":"1"}"#,
        ] {
            assert!(has_serde_private_key(json.as_bytes()), "{json}");
        }
    }

    #[test]
    fn leaves_ordinary_json_alone() {
        for json in [
            r#"{"text":"$serde_json::privat","x":"serde_json::private::RawValue"}"#,
            r#"{"\"$serde_json::private::RawValue":1}"#,
            r#"{"quote\\":1,"$serde_json::public":2}"#,
            r#"{"\u0024serde":1}"#,
            r#"{"title":"$serde_json::private::RawValue","tags":["$serde_json::private::Number"]}"#,
            "\"unterminated \\u00",
            "",
        ] {
            assert!(!has_serde_private_key(json.as_bytes()), "{json}");
        }
    }
}
