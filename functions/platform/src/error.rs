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
