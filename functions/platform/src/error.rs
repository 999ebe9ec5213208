/// The one error type of every port.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A condition did not hold (wrong expected version, item already present, ...). Nothing was written.
    #[error("conflict: the condition of the write did not hold")]
    Conflict,
    /// The addressed record does not exist.
    #[error("not found")]
    NotFound,
    /// The input broke a format or size rule. Nothing was written.
    #[error("invalid input: {0}")]
    Invalid(String),
    /// The backend failed (I/O, corrupt database, lost connection, ...).
    #[error("backend: {0}")]
    Backend(String),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// An error and its causes, outermost first ("error sending request: connection closed before message completed"):
/// the outermost message alone often hides what went wrong.
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
