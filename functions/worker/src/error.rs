use loams_platform::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    #[error("run {0} not found")]
    RunNotFound(String),
    #[error("a record changed under us {0} times in a row; giving up for now")]
    Contended(u32),
    #[error("open refused: {0}")]
    OpenRefused(String),
    /// Another worker (or a crashed one whose lease has not run out) holds the step; try it again later under
    /// the same step id, after `retry_ms`.
    #[error("effect {step} still in progress elsewhere")]
    InProgress { step: String, retry_ms: u64 },
    /// A kill switch stopped the effect before it finished: it has no outcome to record.
    #[error("stopped by a kill switch before the effect finished")]
    Killed,
}

impl WorkerError {
    /// Whether the queue should deliver the message again (after its visibility timeout) rather than drop it.
    pub fn retryable(&self) -> bool {
        !matches!(self, WorkerError::Corrupt(_) | WorkerError::OpenRefused(_))
    }
}
