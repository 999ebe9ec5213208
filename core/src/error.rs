//! The crate's one error type: small and flat, so that `loams-ffi` can expose it as a UniFFI error enum as is.

use loams_proto::connect::{Code, ConnectError};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The server could not be reached (or the platform says there is no network). Nothing was sent, or the
    /// outcome is unknown; nothing was queued and the cache is unchanged.
    #[error("offline: {0}")]
    Offline(String),
    /// The token provider has no valid token, or the server rejected it.
    #[error("not signed in: {0}")]
    Unauthenticated(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("not found: {0}")]
    NotFound(String),
    /// The server refused the request as it stands (e.g. the approval is no longer pending, a bad argument).
    #[error("refused: {0}")]
    Rejected(String),
    /// Approving this action needs the confirmation phrase typed exactly; nothing was sent.
    #[error("the typed confirmation does not match the phrase {phrase:?}")]
    ConfirmationMismatch { phrase: String },
    /// No device key is registered on this installation yet (`devices().register(..)` first).
    #[error("this device is not registered")]
    NotRegistered,
    /// The platform signer or the key store failed.
    #[error("device key: {0}")]
    Signer(String),
    /// The local database failed.
    #[error("cache: {0}")]
    Cache(String),
    /// Input from the caller, a link or a push payload that is malformed or too large.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A link to an app that the allowlist does not name.
    #[error("link not allowed: {0}")]
    NotAllowed(String),
    /// The server broke the protocol or failed internally.
    #[error("server error: {0}")]
    Server(String),
}

impl From<ConnectError> for Error {
    fn from(e: ConnectError) -> Self {
        let msg = e.message;
        match e.code {
            // `unavailable` is also what the Connect client reports for a transport failure (connection refused,
            // reset), so both the server's own "try later" and a dead link read as offline.
            Code::Unavailable | Code::DeadlineExceeded | Code::Canceled => Error::Offline(msg),
            Code::Unauthenticated => Error::Unauthenticated(msg),
            Code::PermissionDenied => Error::PermissionDenied(msg),
            Code::NotFound => Error::NotFound(msg),
            Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::AlreadyExists
            | Code::Aborted
            | Code::OutOfRange
            | Code::ResourceExhausted => Error::Rejected(format!("{}: {msg}", e.code)),
            Code::Unimplemented | Code::Internal | Code::Unknown | Code::DataLoss => {
                Error::Server(format!("{}: {msg}", e.code))
            }
        }
    }
}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Self {
        Error::Cache(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_errors_map_to_what_a_screen_can_act_on() {
        assert!(matches!(
            Error::from(ConnectError::unavailable("transport: refused")),
            Error::Offline(_)
        ));
        assert!(matches!(
            Error::from(ConnectError::deadline_exceeded("slow")),
            Error::Offline(_)
        ));
        assert!(matches!(
            Error::from(ConnectError::failed_precondition("approval is approved")),
            Error::Rejected(_)
        ));
        assert!(matches!(
            Error::from(ConnectError::permission_denied("self approval")),
            Error::PermissionDenied(_)
        ));
        assert!(matches!(
            Error::from(ConnectError::unauthenticated("expired")),
            Error::Unauthenticated(_)
        ));
        assert!(matches!(
            Error::from(ConnectError::unimplemented("no such procedure")),
            Error::Server(_)
        ));
    }
}
