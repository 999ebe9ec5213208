//! The canonical form of an approval's action (agent, skill, arguments, target commit): its SHA-256 is the action
//! hash a decision signs. Defined once, here, so that the server that hashes an action and the phone that checks the
//! action it shows against that hash cannot drift apart.

use serde_json::Value;

/// The canonical JSON text of an action: an object with the keys `agent`, `args`, `skill`, `target_commit` (null
/// when the action applies to no commit), keys sorted at every level, no insignificant whitespace. serde_json's own
/// map order depends on a cargo feature another crate may switch on, so the order is made explicit here.
pub fn canonical_action(
    agent: &str,
    skill: &str,
    args: &Value,
    target_commit: Option<&str>,
) -> String {
    let value = serde_json::json!({
        "agent": agent,
        "skill": skill,
        "args": args,
        "target_commit": target_commit,
    });
    canonical_json(&value)
}

/// The canonical JSON text of any value, as [`canonical_action`] writes its parts: the one text of an approval's
/// arguments the server sends, so that a phone can insist on it (no duplicate keys, spare digits or escapes that
/// would read one way and hash another).
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    canonical(value, &mut out);
    out
}

fn canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                if let Some(inner) = map.get(k) {
                    canonical(inner, out);
                }
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_sorted_at_every_level_without_whitespace() {
        let text = canonical_action(
            "forgejo",
            "merge",
            &json!({"b": [1, {"z": 1, "a": "x"}], "a": null}),
            None,
        );
        assert_eq!(
            text,
            r#"{"agent":"forgejo","args":{"a":null,"b":[1,{"a":"x","z":1}]},"skill":"merge","target_commit":null}"#
        );
        let with_commit = canonical_action("forgejo", "merge", &json!({}), Some("abc"));
        assert!(
            with_commit.ends_with(r#""target_commit":"abc"}"#),
            "{with_commit}"
        );
    }

    #[test]
    fn numbers_read_back_to_their_canonical_text() {
        // A phone parses the server's text of an approval's arguments and hashes what it read: every number must
        // read back to the very value the server hashed (serde_json's float_roundtrip, enabled in this crate;
        // without it about one double in seven came back different).
        let mut x: f64 = 0.1;
        for i in 0..2_000 {
            x = x * 1.000_123_7 + f64::from(i) / 7.0;
            let args =
                json!({"ratio": x, "third": 1.0 / f64::from(i + 3), "tiny": x * 1e-300, "n": i});
            let text = canonical_json(&args);
            let read: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(read, args, "{text}");
            assert_eq!(canonical_json(&read), text);
        }
    }
}
