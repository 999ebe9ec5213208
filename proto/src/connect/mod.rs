//! A hand-written implementation of the Connect protocol (<https://connectrpc.com/docs/protocol>): unary and
//! server-streaming calls with the proto and JSON codecs, a server builder on axum and a client on reqwest.
//!
//! Not supported (answered with `unimplemented` by the server, never sent by the client): compression, GET requests,
//! client and bidirectional streaming.

mod client;
pub mod envelope;
mod error;
mod server;

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use client::ConnectClient;
pub use error::{Code, ConnectError, ErrorDetail};
pub use server::{CallContext, DEFAULT_MAX_MESSAGE_BYTES, Router};

/// What a request or response message must be: protobuf (prost) plus canonical proto3 JSON (pbjson serde).
/// Every generated type of this crate qualifies.
pub trait ConnectMessage:
    prost::Message + Serialize + DeserializeOwned + Default + Send + Sync + 'static
{
}

impl<T> ConnectMessage for T where
    T: prost::Message + Serialize + DeserializeOwned + Default + Send + Sync + 'static
{
}

/// Header names of the protocol.
pub mod headers {
    pub const PROTOCOL_VERSION: &str = "connect-protocol-version";
    pub const TIMEOUT_MS: &str = "connect-timeout-ms";
    pub const CONTENT_ENCODING: &str = "content-encoding";
    pub const STREAM_CONTENT_ENCODING: &str = "connect-content-encoding";
}

/// The message codec of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Codec {
    /// Protobuf binary: `application/proto`, streaming `application/connect+proto`.
    #[default]
    Proto,
    /// Canonical proto3 JSON: `application/json`, streaming `application/connect+json`.
    Json,
}

impl Codec {
    pub fn unary_content_type(self) -> &'static str {
        match self {
            Codec::Proto => "application/proto",
            Codec::Json => "application/json",
        }
    }

    pub fn stream_content_type(self) -> &'static str {
        match self {
            Codec::Proto => "application/connect+proto",
            Codec::Json => "application/connect+json",
        }
    }

    /// The codec of a unary content type (parameters such as `; charset=utf-8` ignored).
    pub fn from_unary_content_type(value: &str) -> Option<Codec> {
        match media_type(value).as_str() {
            "application/proto" => Some(Codec::Proto),
            "application/json" => Some(Codec::Json),
            _ => None,
        }
    }

    /// The codec of a streaming content type.
    pub fn from_stream_content_type(value: &str) -> Option<Codec> {
        match media_type(value).as_str() {
            "application/connect+proto" => Some(Codec::Proto),
            "application/connect+json" => Some(Codec::Json),
            _ => None,
        }
    }

    pub fn encode<M: ConnectMessage>(self, message: &M) -> Result<Vec<u8>, ConnectError> {
        match self {
            Codec::Proto => Ok(message.encode_to_vec()),
            Codec::Json => serde_json::to_vec(message)
                .map_err(|e| ConnectError::internal(format!("encoding JSON message: {e}"))),
        }
    }

    /// Decodes a message; a malformed one is `invalid_argument` (callers on the client side re-map it).
    pub fn decode<M: ConnectMessage>(self, bytes: &[u8]) -> Result<M, ConnectError> {
        match self {
            Codec::Proto => M::decode(bytes)
                .map_err(|e| ConnectError::invalid_argument(format!("malformed protobuf: {e}"))),
            // An empty JSON body stands for the empty message, as an empty protobuf body does.
            Codec::Json if bytes.iter().all(u8::is_ascii_whitespace) => Ok(M::default()),
            Codec::Json => serde_json::from_slice(bytes)
                .map_err(|e| ConnectError::invalid_argument(format!("malformed JSON: {e}"))),
        }
    }
}

fn media_type(value: &str) -> String {
    value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// The JSON payload of the EndStream frame.
#[derive(Serialize, Deserialize, Default)]
struct EndStream {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<error::WireError>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    metadata: BTreeMap<String, Vec<String>>,
}

impl EndStream {
    fn encode(result: Result<(), &ConnectError>) -> Vec<u8> {
        let end = match result {
            Ok(()) => EndStream::default(),
            Err(e) => EndStream {
                error: Some(e.to_wire()),
                metadata: e.metadata.clone(),
            },
        };
        serde_json::to_vec(&end).unwrap_or_else(|_| br#"{"error":{"code":"internal"}}"#.to_vec())
    }

    /// `Ok(())` for a clean end, the carried error otherwise.
    fn decode(payload: &[u8]) -> Result<(), ConnectError> {
        let end: EndStream = serde_json::from_slice(payload)
            .map_err(|e| ConnectError::internal(format!("malformed EndStream frame: {e}")))?;
        match end.error {
            None => Ok(()),
            Some(wire) => {
                let mut err = ConnectError::from_wire(wire);
                err.metadata = end.metadata;
                Err(err)
            }
        }
    }
}
