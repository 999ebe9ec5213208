use std::time::Duration;

use loams_a2a::SkillError;

/// Why an agent could not be built or a skill could not run. Converted to [`SkillError`] at the A2A boundary;
/// messages never contain credentials.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("invalid agent config: {0}")]
    Config(String),
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    #[error("unknown skill `{0}`")]
    UnknownSkill(String),
    /// No answer from the app even after the retries the call allowed (connection refused, timeouts, lost
    /// connections on calls safe to repeat): the call did not happen or is safe to repeat; retry later.
    #[error("{app}: {call}: {message}")]
    Transport {
        app: &'static str,
        /// `METHOD /path`.
        call: String,
        message: String,
    },
    /// The app answered with a non-success status; `message` is the app's own error text (or a body excerpt).
    #[error("{app}: {call}: HTTP {status} (after {attempts} attempt(s)): {message}")]
    Status {
        app: &'static str,
        call: String,
        status: u16,
        attempts: u32,
        message: String,
    },
    /// The app kept answering 429, or asked to wait longer than the client's cap.
    #[error("{app}: {call}: rate limited (HTTP 429) after {attempts} attempt(s){}", retry_after_text(.retry_after))]
    RateLimited {
        app: &'static str,
        call: String,
        attempts: u32,
        retry_after: Option<Duration>,
    },
    /// A call that is not safe to repeat was sent but its answer was lost (timeout, dropped connection, a 5xx): it
    /// may or may not have taken effect. Not retried; look the effect up before trying again.
    #[error(
        "{app}: {call}: outcome unknown, the request may have been applied ({message}); not retried, check the app \
         before repeating it"
    )]
    Uncertain {
        app: &'static str,
        call: String,
        message: String,
    },
    /// A success status with a body we cannot use (bad JSON, too large, missing fields).
    #[error("{app}: bad response: {message}")]
    BadResponse { app: &'static str, message: String },
    /// The app's state forbids the action (e.g. merge of a closed PR, head moved since approval).
    #[error("{0}")]
    Refused(String),
}

impl AgentError {
    /// Only transport failures, 429 and 5xx may succeed on a retry; an unknown outcome must be looked up first.
    pub fn retryable(&self) -> bool {
        match self {
            AgentError::Transport { .. } | AgentError::RateLimited { .. } => true,
            AgentError::Status { status, .. } => *status == 429 || *status >= 500,
            _ => false,
        }
    }

    /// An [`AgentError::Uncertain`] whose effect could not be looked up either: still uncertain, now also naming
    /// the lookup's failure. The lookup's own error (a timeout, a 5xx, a 429) must not take its place: those count
    /// as retryable, and a retry of the skill would send the lost call a second time. Other errors are final
    /// already and stay as they are.
    pub(crate) fn unresolved(self, lookup: &AgentError) -> AgentError {
        match self {
            AgentError::Uncertain { app, call, message } => AgentError::Uncertain {
                app,
                call,
                message: format!("{message}; looking for its effect failed too: {lookup}"),
            },
            other => other,
        }
    }
}

impl From<AgentError> for SkillError {
    fn from(e: AgentError) -> Self {
        SkillError {
            retryable: e.retryable(),
            message: e.to_string(),
        }
    }
}

fn retry_after_text(wait: &Option<Duration>) -> String {
    match wait {
        Some(d) => format!("; the app asked to wait {} s", d.as_secs_f64().ceil()),
        None => String::new(),
    }
}
