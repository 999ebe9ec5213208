//! loams-agents: the five A2A agents (zulip, plane, forgejo, glitchtip, analytics) and their app API clients.
//!
//! Each module holds one app: its config, a typed HTTP client for the endpoints the skills need (official API
//! shapes, see shared/api-specs), and the agent that implements [`loams_a2a::Skills`] on top of it.

mod error;
mod http;
mod time;

pub mod analytics;
pub mod forgejo;
pub mod glitchtip;
pub mod plane;
pub mod zulip;

pub use analytics::{AnalyticsAgent, AnalyticsConfig, OpenPanelClient};
pub use error::AgentError;
pub use forgejo::{ForgejoAgent, ForgejoClient, ForgejoConfig};
pub use glitchtip::{GlitchTipAgent, GlitchTipClient, GlitchTipConfig};
pub use http::{DEFAULT_TIMEOUT, MAX_RESPONSE_BYTES, RetryPolicy, warm_up_http_client};
pub use plane::{PlaneAgent, PlaneClient, PlaneConfig};
pub use zulip::{ZulipAgent, ZulipClient, ZulipConfig};

use loams_a2a::{AppLinks, Risk, SkillSpec};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Version advertised on every agent card.
pub(crate) const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

pub(crate) fn skill(
    id: &str,
    name: &str,
    description: &str,
    risk: Risk,
    examples: &[&str],
) -> SkillSpec {
    SkillSpec {
        id: id.into(),
        name: name.into(),
        description: description.into(),
        risk,
        tags: Vec::new(),
        examples: examples.iter().map(|e| (*e).to_string()).collect(),
    }
}

/// Decodes a skill's `args`; unknown fields are refused by the arg structs so a typo is not silently ignored.
/// ProtoJSON peers (the A2A SDKs carry a data part as `google.protobuf.Struct`) send every number as a
/// double, so an integral `42.0` is read as the integer 42; a fraction where an integer is due stays an error.
pub(crate) fn args<T: DeserializeOwned>(
    skill: &str,
    value: serde_json::Value,
) -> Result<T, AgentError> {
    serde_json::from_value(integral_floats_as_ints(value))
        .map_err(|e| AgentError::InvalidArgs(format!("{skill}: {e}")))
}

/// Largest magnitude up to which every integer is exact in an f64 (2^53).
const MAX_EXACT_F64: f64 = 9_007_199_254_740_992.0;

fn integral_floats_as_ints(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Number(n) if n.is_f64() => match n.as_f64() {
            Some(f) if f.fract() == 0.0 && f.abs() <= MAX_EXACT_F64 => Value::from(f as i64),
            _ => Value::Number(n),
        },
        Value::Array(items) => {
            Value::Array(items.into_iter().map(integral_floats_as_ints).collect())
        }
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, integral_floats_as_ints(v)))
                .collect(),
        ),
        other => other,
    }
}

/// Checks a caller-supplied string is present and bounded (they end up in URLs and request bodies).
pub(crate) fn require(field: &str, value: &str, max: usize) -> Result<(), AgentError> {
    if value.trim().is_empty() {
        return Err(AgentError::InvalidArgs(format!("`{field}` is empty")));
    }
    if value.len() > max {
        return Err(AgentError::InvalidArgs(format!(
            "`{field}` is longer than {max} bytes"
        )));
    }
    Ok(())
}

/// The app an agent works on, for its card: the web address `base` (as configured, without a trailing slash) and
/// its page links, each template given relative to that address. A placeholder is named after the field of the
/// panel object that fills it (loams.collab.v1).
pub(crate) fn app_links(base: &reqwest::Url, templates: &[(&str, String)]) -> AppLinks {
    let web = base.as_str().trim_end_matches('/');
    AppLinks {
        web_url: web.into(),
        deep_link_templates: templates
            .iter()
            .map(|(object, path)| ((*object).to_string(), format!("{web}{path}")))
            .collect(),
    }
}

/// The answer of a panel read (`get_*` skills): the object with `"found": true`, or `{"found": false}` when the
/// app answers 404, so a missing object is an answer the caller can show rather than a failed call.
pub(crate) fn found(read: Result<Value, AgentError>) -> Result<Value, AgentError> {
    match read {
        Ok(Value::Object(mut fields)) => {
            fields.insert("found".into(), Value::Bool(true));
            Ok(Value::Object(fields))
        }
        Ok(other) => Ok(other),
        Err(AgentError::Status { status: 404, .. }) => Ok(serde_json::json!({"found": false})),
        Err(e) => Err(e),
    }
}

/// Minimal HTML for Plane's `*_html` fields: the text escaped, one paragraph per line.
pub(crate) fn text_to_html(text: &str) -> String {
    text.lines()
        .map(|l| {
            let escaped = l
                .replace('&', "&amp;")
                .replace('<', "&lt;")
                .replace('>', "&gt;")
                .replace('"', "&quot;");
            format!("<p>{escaped}</p>")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(serde::Deserialize, Debug, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Args {
        since_ms: i64,
        ids: Vec<u64>,
        ratio: f64,
    }

    #[test]
    fn protojson_doubles_decode_as_integers_when_integral() {
        let got: Args = args(
            "s",
            json!({"since_ms": 1764500000000.0, "ids": [1.0, 2], "ratio": 3.0}),
        )
        .unwrap();
        assert_eq!(
            got,
            Args {
                since_ms: 1_764_500_000_000,
                ids: vec![1, 2],
                ratio: 3.0
            }
        );
        assert!(args::<Args>("s", json!({"since_ms": 1.5, "ids": [], "ratio": 0})).is_err());
    }
}
