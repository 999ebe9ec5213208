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
    /// Could not reach the app or the body broke off: the call may not have happened; retry.
    #[error("{app}: transport error: {message}")]
    Transport { app: &'static str, message: String },
    /// The app answered with a non-success status; `body` is a short excerpt.
    #[error("{app}: HTTP {status}: {body}")]
    Status {
        app: &'static str,
        status: u16,
        body: String,
    },
    /// A success status with a body we cannot use (bad JSON, too large, missing fields).
    #[error("{app}: bad response: {message}")]
    BadResponse { app: &'static str, message: String },
    /// The app's state forbids the action (e.g. merge of a closed PR, head moved since approval).
    #[error("{0}")]
    Refused(String),
}

impl AgentError {
    /// Only transport failures, 429 and 5xx may succeed on a retry.
    pub fn retryable(&self) -> bool {
        match self {
            AgentError::Transport { .. } => true,
            AgentError::Status { status, .. } => *status == 429 || *status >= 500,
            _ => false,
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
