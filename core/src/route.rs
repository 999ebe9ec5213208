//! Push payloads and `loams://` deep links, parsed into a [`Route`]: a screen to open. A route only navigates:
//! no link form carries a decision, a kill or a message, and a query string or fragment is refused rather than
//! ignored, so nothing can ride along into a later action.
//!
//! Forms: `loams://runs/<run id>`, `loams://approvals/<approval id>`, `loams://bot/threads/<thread id>`,
//! `loams://app/<env>/<app>/<path>` (the app must be on the app registry's allowlist).

use crate::error::{Error, Result};

/// Longest link accepted (also what fits a push payload comfortably).
pub const MAX_LINK: usize = 2048;
/// APNs allows 4 KiB of payload, FCM a little less; anything larger is not a Loams push.
pub const MAX_PUSH: usize = 4096;
const MAX_ID: usize = 128;
const MAX_NAME: usize = 63;
const MAX_APP_PATH: usize = 1024;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    Run {
        run_id: String,
    },
    Approval {
        approval_id: String,
    },
    BotThread {
        thread_id: String,
    },
    /// A page of an app (Forgejo, Plane, ...) in an environment; the platform opens it through the registry's
    /// deep-link template. `path` is percent-encoded as it came, without a leading slash, possibly empty.
    App {
        env: String,
        app: String,
        path: String,
    },
}

/// One app of the registry's allowlist that links may open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowedApp {
    pub env: String,
    pub app: String,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::InvalidInput(msg.into())
}

/// Parses a `loams://` link.
pub fn parse_link(link: &str, allowlist: &[AllowedApp]) -> Result<Route> {
    if link.len() > MAX_LINK {
        return Err(bad(format!("a link is at most {MAX_LINK} bytes")));
    }
    let (scheme, rest) = link
        .split_once("://")
        .ok_or_else(|| bad("not a loams:// link"))?;
    if !scheme.eq_ignore_ascii_case("loams") {
        return Err(bad("not a loams:// link"));
    }
    if let Some(c) = rest
        .chars()
        .find(|c| matches!(c, '?' | '#' | '\\') || c.is_whitespace() || c.is_control())
    {
        return Err(bad(format!(
            "a link may not contain {c:?} (no query, fragment or spaces)"
        )));
    }
    let segments: Vec<&str> = rest.split('/').collect();
    match segments.as_slice() {
        ["runs", id] => Ok(Route::Run {
            run_id: id_segment("run id", id)?,
        }),
        ["approvals", id] => Ok(Route::Approval {
            approval_id: id_segment("approval id", id)?,
        }),
        ["bot", "threads", id] => Ok(Route::BotThread {
            thread_id: id_segment("thread id", id)?,
        }),
        ["app", env, app, path @ ..] => {
            let env = name_segment("env", env)?;
            let app = name_segment("app", app)?;
            if !allowlist.iter().any(|a| a.env == env && a.app == app) {
                return Err(Error::NotAllowed(format!(
                    "app {app} in {env} is not on the allowlist"
                )));
            }
            Ok(Route::App {
                env,
                app,
                path: app_path(path)?,
            })
        }
        _ => Err(bad("unknown link form")),
    }
}

/// Parses a push payload (the JSON an APNs or FCM message carries): it names a `link`, at the top level (APNs
/// custom key) or under `data` (FCM), and optionally the `org` it is for. A push for another organisation than the
/// account's is refused. Push payloads carry ids and a link, never content.
pub fn parse_push(payload: &str, org: &str, allowlist: &[AllowedApp]) -> Result<Route> {
    if payload.len() > MAX_PUSH {
        return Err(bad(format!("a push payload is at most {MAX_PUSH} bytes")));
    }
    let value: serde_json::Value = serde_json::from_str(payload)
        .map_err(|e| bad(format!("the push payload is not JSON: {e}")))?;
    let top = value
        .as_object()
        .ok_or_else(|| bad("the push payload is not a JSON object"))?;
    let data = match top.get("data") {
        Some(serde_json::Value::Object(data)) if !top.contains_key("link") => data,
        _ => top,
    };
    match data.get("org") {
        None => {}
        Some(serde_json::Value::String(o)) if o == org => {}
        Some(serde_json::Value::String(_)) => {
            return Err(Error::NotAllowed(
                "the push is for another organisation".into(),
            ));
        }
        Some(_) => return Err(bad("the push payload's org is not a string")),
    }
    match data.get("link") {
        Some(serde_json::Value::String(link)) => parse_link(link, allowlist),
        Some(_) => Err(bad("the push payload's link is not a string")),
        None => Err(bad("the push payload has no link")),
    }
}

fn id_segment(what: &str, s: &str) -> Result<String> {
    let ok = !s.is_empty()
        && s.len() <= MAX_ID
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b':'));
    if !ok {
        return Err(bad(format!(
            "{what} must be 1..={MAX_ID} of [A-Za-z0-9._:-]"
        )));
    }
    Ok(s.to_owned())
}

fn name_segment(what: &str, s: &str) -> Result<String> {
    let b = s.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= MAX_NAME
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-');
    if !ok {
        return Err(bad(format!("{what} must match [a-z0-9][a-z0-9-]{{0,62}}")));
    }
    Ok(s.to_owned())
}

/// An app path: segments of URI path characters or valid percent escapes; none that decodes to `.` or `..`, a
/// slash, a backslash or a control character, so the app's template cannot be walked out of.
fn app_path(segments: &[&str]) -> Result<String> {
    let path = segments.join("/");
    if path.len() > MAX_APP_PATH {
        return Err(bad(format!("an app path is at most {MAX_APP_PATH} bytes")));
    }
    for (i, seg) in segments.iter().enumerate() {
        // A trailing slash is fine; an empty segment inside is not.
        if seg.is_empty() && i + 1 < segments.len() {
            return Err(bad("an app path may not contain an empty segment"));
        }
        let decoded = percent_decode(seg)?;
        if decoded == b"." || decoded == b".." {
            return Err(bad("an app path may not contain . or .. segments"));
        }
        if decoded
            .iter()
            .any(|c| *c == b'/' || *c == b'\\' || c.is_ascii_control())
        {
            return Err(bad(
                "an app path segment may not encode a slash or a control character",
            ));
        }
    }
    Ok(path)
}

fn percent_decode(seg: &str) -> Result<Vec<u8>> {
    let b = seg.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .ok_or_else(|| bad("a truncated percent escape"))?;
            let text = std::str::from_utf8(hex).map_err(|_| bad("a malformed percent escape"))?;
            let v = u8::from_str_radix(text, 16).map_err(|_| bad("a malformed percent escape"))?;
            out.push(v);
            i += 3;
            continue;
        }
        let allowed = c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'-' | b'.'
                    | b'_'
                    | b'~'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
                    | b':'
                    | b'@'
            );
        if !allowed {
            return Err(bad(format!("an app path may not contain {:?}", c as char)));
        }
        out.push(c);
        i += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow() -> Vec<AllowedApp> {
        vec![AllowedApp {
            env: "prod".into(),
            app: "forgejo".into(),
        }]
    }

    #[test]
    fn the_four_forms() {
        let a = allow();
        assert_eq!(
            parse_link("loams://runs/r-0123456789abcdef", &a),
            Ok(Route::Run {
                run_id: "r-0123456789abcdef".into()
            })
        );
        assert_eq!(
            parse_link("LOAMS://approvals/ap-1", &a),
            Ok(Route::Approval {
                approval_id: "ap-1".into()
            })
        );
        assert_eq!(
            parse_link("loams://bot/threads/t:1", &a),
            Ok(Route::BotThread {
                thread_id: "t:1".into()
            })
        );
        assert_eq!(
            parse_link("loams://app/prod/forgejo/acme/shop/pulls/7", &a),
            Ok(Route::App {
                env: "prod".into(),
                app: "forgejo".into(),
                path: "acme/shop/pulls/7".into()
            })
        );
        assert_eq!(
            parse_link("loams://app/prod/forgejo", &a),
            Ok(Route::App {
                env: "prod".into(),
                app: "forgejo".into(),
                path: String::new()
            })
        );
        assert_eq!(
            parse_link("loams://app/prod/forgejo/a%20b/", &a),
            Ok(Route::App {
                env: "prod".into(),
                app: "forgejo".into(),
                path: "a%20b/".into()
            })
        );
    }

    #[test]
    fn links_never_act_and_malformed_ones_are_errors() {
        let a = allow();
        for link in [
            "",
            "loams:",
            "loams://",
            "https://runs/r-1",
            "loams://runs",
            "loams://runs/",
            "loams://runs/r-1/",
            "loams://runs/r-1/kill",
            "loams://runs/r-1?action=kill",
            "loams://approvals/ap-1#approve",
            "loams://approvals/ap-1/approve",
            "loams://approvals/..",
            "loams://approvals/a b",
            "loams://approvals/a%2F",
            "loams://bot/threads",
            "loams://bot/t-1",
            "loams://app/prod",
            "loams://app/Prod/forgejo/x",
            "loams://app/prod/forgejo/../admin",
            "loams://app/prod/forgejo/%2e%2E/admin",
            "loams://app/prod/forgejo/a%2Fb",
            "loams://app/prod/forgejo/a//b",
            "loams://app/prod/forgejo/a%zz",
            "loams://app/prod/forgejo/a%4",
            "loams://app/prod/forgejo/a\\b",
            "loams://app/prod/forgejo/a<b",
        ] {
            assert!(
                matches!(parse_link(link, &a), Err(Error::InvalidInput(_))),
                "{link:?} => {:?}",
                parse_link(link, &a)
            );
        }
        let long = format!("loams://runs/{}", "a".repeat(MAX_ID + 1));
        assert!(parse_link(&long, &a).is_err());
        let huge = format!("loams://app/prod/forgejo/{}", "a".repeat(MAX_LINK));
        assert!(parse_link(&huge, &a).is_err());
    }

    #[test]
    fn apps_must_be_on_the_allowlist() {
        let a = allow();
        assert!(matches!(
            parse_link("loams://app/prod/plane/x", &a),
            Err(Error::NotAllowed(_))
        ));
        assert!(matches!(
            parse_link("loams://app/staging/forgejo/x", &a),
            Err(Error::NotAllowed(_))
        ));
        assert!(matches!(
            parse_link("loams://app/prod/forgejo/x", &[]),
            Err(Error::NotAllowed(_))
        ));
    }

    #[test]
    fn push_payloads() {
        let a = allow();
        let apns =
            r#"{"aps":{"alert":"Approval needed"},"org":"acme","link":"loams://approvals/ap-9"}"#;
        assert_eq!(
            parse_push(apns, "acme", &a),
            Ok(Route::Approval {
                approval_id: "ap-9".into()
            })
        );
        let fcm = r#"{"data":{"link":"loams://runs/r-1","org":"acme"}}"#;
        assert_eq!(
            parse_push(fcm, "acme", &a),
            Ok(Route::Run {
                run_id: "r-1".into()
            })
        );
        assert_eq!(
            parse_push(r#"{"link":"loams://runs/r-1"}"#, "acme", &a),
            Ok(Route::Run {
                run_id: "r-1".into()
            })
        );
        assert!(matches!(
            parse_push(apns, "other", &a),
            Err(Error::NotAllowed(_))
        ));
        for bad in [
            "",
            "null",
            "[]",
            "{}",
            r#"{"link":5}"#,
            r#"{"link":"loams://runs/r-1","org":7}"#,
            r#"{"data":{"link":"https://evil"}}"#,
            r#"{"link":"loams://runs/r-1""#,
        ] {
            assert!(
                matches!(parse_push(bad, "acme", &a), Err(Error::InvalidInput(_))),
                "{bad:?}"
            );
        }
        let big = format!(
            r#"{{"link":"loams://runs/r-1","pad":"{}"}}"#,
            "x".repeat(MAX_PUSH)
        );
        assert!(matches!(
            parse_push(&big, "acme", &a),
            Err(Error::InvalidInput(_))
        ));
        let deep = format!("{}{}", "[".repeat(3000), "]".repeat(3000));
        assert!(parse_push(&deep, "acme", &a).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_links_never_panic(s in "\\PC{0,300}") {
            let _ = parse_link(&s, &allow());
        }

        #[test]
        fn arbitrary_link_tails_never_panic(s in "(runs|approvals|bot/threads|app/prod/forgejo)/[ -~%]{0,80}") {
            let _ = parse_link(&format!("loams://{s}"), &allow());
        }

        #[test]
        fn arbitrary_push_payloads_never_panic(s in "\\PC{0,300}") {
            let _ = parse_push(&s, "acme", &allow());
        }

        #[test]
        fn parsed_ids_round_trip(id in "[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,100}") {
            proptest::prop_assert_eq!(parse_link(&format!("loams://runs/{id}"), &[]), Ok(Route::Run { run_id: id }));
        }
    }
}
