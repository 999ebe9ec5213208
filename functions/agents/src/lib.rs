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
pub use http::{DEFAULT_TIMEOUT, MAX_RESPONSE_BYTES};
pub use plane::{PlaneAgent, PlaneClient, PlaneConfig};
pub use zulip::{ZulipAgent, ZulipClient, ZulipConfig};

use loams_a2a::{Risk, SkillSpec};
use serde::de::DeserializeOwned;

/// Version advertised on every agent card.
pub(crate) const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

pub(crate) fn skill(id: &str, name: &str, description: &str, risk: Risk, examples: &[&str]) -> SkillSpec {
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
pub(crate) fn args<T: DeserializeOwned>(skill: &str, value: serde_json::Value) -> Result<T, AgentError> {
    serde_json::from_value(value).map_err(|e| AgentError::InvalidArgs(format!("{skill}: {e}")))
}

/// Checks a caller-supplied string is present and bounded (they end up in URLs and request bodies).
pub(crate) fn require(field: &str, value: &str, max: usize) -> Result<(), AgentError> {
    if value.trim().is_empty() {
        return Err(AgentError::InvalidArgs(format!("`{field}` is empty")));
    }
    if value.len() > max {
        return Err(AgentError::InvalidArgs(format!("`{field}` is longer than {max} bytes")));
    }
    Ok(())
}

/// Minimal HTML for Plane's `*_html` fields: the text escaped, one paragraph per line.
pub(crate) fn text_to_html(text: &str) -> String {
    text.lines()
        .map(|l| {
            let escaped = l.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;");
            format!("<p>{escaped}</p>")
        })
        .collect()
}
