//! Connect error codes, their HTTP statuses, and the error JSON (`{"code":"not_found","message":"..."}`).

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine as _;
use base64::engine::{GeneralPurpose, GeneralPurposeConfig, general_purpose::STANDARD_NO_PAD};
use http::StatusCode;
use serde::{Deserialize, Serialize};

/// The 16 Connect error codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub const ALL: [Code; 16] = [
        Code::Canceled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// The wire name (`"not_found"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// Parses a wire name; `None` for anything that is not one of the 16 codes.
    pub fn from_wire(name: &str) -> Option<Code> {
        Code::ALL.into_iter().find(|c| c.as_str() == name)
    }

    /// The HTTP status of a unary error with this code (Connect protocol table).
    pub fn http_status(self) -> StatusCode {
        match self {
            // 499 is nginx's "client closed request"; `from_u16` accepts any 3-digit status.
            Code::Canceled => {
                StatusCode::from_u16(499).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }

    /// The code a client infers from an HTTP status when the body is not a Connect error (for example a proxy's
    /// answer). This is the Connect protocol's HTTP-to-code table, which is deliberately not the inverse of
    /// [`Code::http_status`].
    pub fn from_http_status(status: StatusCode) -> Code {
        match status.as_u16() {
            400 => Code::Internal,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::Unimplemented,
            429 | 502 | 503 | 504 => Code::Unavailable,
            _ => Code::Unknown,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Code {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Code {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        // An unknown code from a newer peer is still an error; `unknown` is the honest reading of it.
        Ok(Code::from_wire(&name).unwrap_or(Code::Unknown))
    }
}

/// One entry of an error's `details`: a protobuf message packed like `google.protobuf.Any`.
#[derive(Clone, Debug, PartialEq)]
pub struct ErrorDetail {
    /// Fully-qualified message name, without a `type.googleapis.com/` prefix (e.g. `loams.approvals.v1.Approval`).
    pub type_name: String,
    /// The message in protobuf binary encoding.
    pub value: Vec<u8>,
    /// Optional JSON rendering for humans; never parsed.
    pub debug: Option<serde_json::Value>,
}

/// A Connect error: the only error type of the protocol layer, and what handlers return.
///
/// `metadata` travels as response headers of a unary error and as the `metadata` of a streaming EndStream frame.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
    pub details: Vec<ErrorDetail>,
    pub metadata: BTreeMap<String, Vec<String>>,
}

macro_rules! constructors {
    ($($name:ident => $code:ident),* $(,)?) => {
        $(
            #[doc = concat!("A `", stringify!($name), "` error.")]
            pub fn $name(message: impl Into<String>) -> Self {
                Self::new(Code::$code, message)
            }
        )*
    };
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            details: Vec::new(),
            metadata: BTreeMap::new(),
        }
    }

    constructors! {
        canceled => Canceled,
        unknown => Unknown,
        invalid_argument => InvalidArgument,
        deadline_exceeded => DeadlineExceeded,
        not_found => NotFound,
        already_exists => AlreadyExists,
        permission_denied => PermissionDenied,
        resource_exhausted => ResourceExhausted,
        failed_precondition => FailedPrecondition,
        aborted => Aborted,
        out_of_range => OutOfRange,
        unimplemented => Unimplemented,
        internal => Internal,
        unavailable => Unavailable,
        data_loss => DataLoss,
        unauthenticated => Unauthenticated,
    }

    /// Attaches a protobuf message as an error detail.
    pub fn with_detail<M: prost::Message + prost::Name>(mut self, message: &M) -> Self {
        self.details.push(ErrorDetail {
            type_name: M::full_name(),
            value: message.encode_to_vec(),
            debug: None,
        });
        self
    }

    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata
            .entry(key.into())
            .or_default()
            .push(value.into());
        self
    }

    /// The error JSON object (`{"code":..,"message":..,"details":[..]}`), as used in unary bodies and EndStream.
    pub(crate) fn to_wire(&self) -> WireError {
        WireError {
            code: self.code,
            message: (!self.message.is_empty()).then(|| self.message.clone()),
            details: self
                .details
                .iter()
                .map(|d| WireDetail {
                    type_name: d.type_name.clone(),
                    value: STANDARD_NO_PAD.encode(&d.value),
                    debug: d.debug.clone(),
                })
                .collect(),
        }
    }

    pub(crate) fn from_wire(wire: WireError) -> Self {
        let details = wire
            .details
            .into_iter()
            // A detail whose value is not base64 is dropped rather than failing the whole error.
            .filter_map(|d| {
                Some(ErrorDetail {
                    type_name: d.type_name,
                    value: LENIENT_BASE64.decode(d.value).ok()?,
                    debug: d.debug,
                })
            })
            .collect();
        Self {
            code: wire.code,
            message: wire.message.unwrap_or_default(),
            details,
            metadata: BTreeMap::new(),
        }
    }

    /// The error JSON body as bytes.
    pub fn to_json(&self) -> Vec<u8> {
        // Serialising plain strings and JSON values into a Vec cannot fail.
        serde_json::to_vec(&self.to_wire()).unwrap_or_else(|_| br#"{"code":"internal"}"#.to_vec())
    }
}

/// Connect peers may send base64 with or without padding.
const LENIENT_BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

#[derive(Serialize, Deserialize)]
pub(crate) struct WireError {
    code: Code,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    message: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    details: Vec<WireDetail>,
}

#[derive(Serialize, Deserialize)]
struct WireDetail {
    #[serde(rename = "type")]
    type_name: String,
    value: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    debug: Option<serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_round_trip() {
        for code in Code::ALL {
            assert_eq!(Code::from_wire(code.as_str()), Some(code));
        }
        assert_eq!(Code::from_wire("NOT_FOUND"), None);
    }

    #[test]
    fn http_status_to_code_follows_the_protocol_table() {
        assert_eq!(
            Code::from_http_status(StatusCode::BAD_REQUEST),
            Code::Internal
        );
        assert_eq!(
            Code::from_http_status(StatusCode::NOT_FOUND),
            Code::Unimplemented
        );
        assert_eq!(
            Code::from_http_status(StatusCode::BAD_GATEWAY),
            Code::Unavailable
        );
        assert_eq!(
            Code::from_http_status(StatusCode::IM_A_TEAPOT),
            Code::Unknown
        );
    }

    #[test]
    fn error_json_with_details_round_trips_and_accepts_padding() {
        let err = ConnectError {
            code: Code::FailedPrecondition,
            message: "m".into(),
            details: vec![ErrorDetail {
                type_name: "a.B".into(),
                value: vec![1, 2, 3, 4],
                debug: None,
            }],
            metadata: BTreeMap::new(),
        };
        let json: serde_json::Value = serde_json::from_slice(&err.to_json()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"code": "failed_precondition", "message": "m", "details": [{"type": "a.B", "value": "AQIDBA"}]})
        );
        let back: WireError = serde_json::from_value(json).unwrap();
        assert_eq!(ConnectError::from_wire(back), err);

        let padded: WireError =
            serde_json::from_str(r#"{"code":"failed_precondition","message":"m","details":[{"type":"a.B","value":"AQIDBA=="}]}"#)
                .unwrap();
        assert_eq!(ConnectError::from_wire(padded), err);
    }

    #[test]
    fn unknown_code_from_a_peer_reads_as_unknown() {
        let wire: WireError = serde_json::from_str(r#"{"code":"brand_new"}"#).unwrap();
        assert_eq!(ConnectError::from_wire(wire).code, Code::Unknown);
    }
}
