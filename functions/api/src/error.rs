use loams_factory::approval::Refusal;
use loams_platform::StoreError;
use loams_proto::connect::ConnectError;

/// The one error of this crate; mapped once to the Connect wire (and to HTTP statuses for webhooks).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// A concurrent call holds the same idempotency key or won a conditional write; retrying later is safe.
    #[error("aborted: {0}")]
    Aborted(String),
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("internal: {0}")]
    Internal(String),
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Conflict => {
                ApiError::Aborted("a concurrent write changed the record; retry".into())
            }
            StoreError::NotFound => ApiError::NotFound("record not found".into()),
            StoreError::Invalid(m) => ApiError::InvalidArgument(m),
            StoreError::Backend(m) => {
                tracing::error!(error = %m, "store backend failed");
                ApiError::Unavailable("storage is unavailable".into())
            }
        }
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> Self {
        let msg = r.to_string();
        match r {
            Refusal::BadSignature
            | Refusal::DeviceUnknown
            | Refusal::DeviceRevoked
            | Refusal::SelfApproval => ApiError::PermissionDenied(msg),
            Refusal::Expired
            | Refusal::ChallengeUsed
            | Refusal::AlreadyDecided
            | Refusal::ActionHashMismatch => ApiError::FailedPrecondition(msg),
            Refusal::ChallengeMismatch | Refusal::ConfirmationMismatch => {
                ApiError::InvalidArgument(msg)
            }
        }
    }
}

impl From<ApiError> for ConnectError {
    fn from(e: ApiError) -> Self {
        match e {
            ApiError::Unauthenticated(m) => ConnectError::unauthenticated(m),
            ApiError::NotFound(m) => ConnectError::not_found(m),
            ApiError::InvalidArgument(m) => ConnectError::invalid_argument(m),
            ApiError::PermissionDenied(m) => ConnectError::permission_denied(m),
            ApiError::FailedPrecondition(m) => ConnectError::failed_precondition(m),
            ApiError::AlreadyExists(m) => ConnectError::already_exists(m),
            ApiError::Aborted(m) => ConnectError::aborted(m),
            ApiError::Unavailable(m) => ConnectError::unavailable(m),
            // Internal details go to the log, not to the caller.
            ApiError::Internal(m) => {
                tracing::error!(error = %m, "internal error");
                ConnectError::internal("internal error")
            }
        }
    }
}
