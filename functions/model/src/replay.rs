use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::Mutex;

use async_trait::async_trait;
use serde::Deserialize;

use crate::{ChatModel, ChatRequest, ChatResponse, ModelError};

/// Largest cassette we load; recorded completions for a demo or a test suite are far smaller.
pub const MAX_CASSETTE_BYTES: u64 = 16 * 1024 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Cassette {
    completions: Vec<Recorded>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Recorded {
    purpose: String,
    text: String,
    input_tokens: u64,
    output_tokens: u64,
}

/// Serves recorded completions in order, one queue per purpose, ignoring the request's messages: the same client
/// code runs offline and in tests. Shared safely between tasks.
#[derive(Debug)]
pub struct Replay {
    tracks: Mutex<HashMap<String, VecDeque<ChatResponse>>>,
}

impl Replay {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| {
            ModelError::Config(format!("cannot read cassette {}: {e}", path.display()))
        })?;
        if meta.len() > MAX_CASSETTE_BYTES {
            return Err(ModelError::Config(format!(
                "cassette {} is larger than {MAX_CASSETTE_BYTES} bytes",
                path.display()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| {
            ModelError::Config(format!("cannot read cassette {}: {e}", path.display()))
        })?;
        Self::from_json_str(&text)
    }

    pub fn from_json_str(json: &str) -> Result<Self, ModelError> {
        if json.len() as u64 > MAX_CASSETTE_BYTES {
            return Err(ModelError::Config(format!(
                "cassette is larger than {MAX_CASSETTE_BYTES} bytes"
            )));
        }
        let cassette: Cassette = serde_json::from_str(json)
            .map_err(|e| ModelError::Config(format!("invalid cassette: {e}")))?;
        let mut tracks: HashMap<String, VecDeque<ChatResponse>> = HashMap::new();
        for r in cassette.completions {
            if r.purpose.is_empty() {
                return Err(ModelError::Config(
                    "invalid cassette: a completion has an empty purpose".into(),
                ));
            }
            tracks
                .entry(r.purpose)
                .or_default()
                .push_back(ChatResponse {
                    text: r.text,
                    model: "replay".into(),
                    input_tokens: r.input_tokens,
                    output_tokens: r.output_tokens,
                });
        }
        Ok(Self {
            tracks: Mutex::new(tracks),
        })
    }

    /// How many completions are left for `purpose`.
    pub fn remaining(&self, purpose: &str) -> usize {
        self.lock().get(purpose).map_or(0, VecDeque::len)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<ChatResponse>>> {
        // A panic while holding the lock cannot leave the map half-updated (pop_front is atomic), so recover it.
        self.tracks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl ChatModel for Replay {
    async fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, ModelError> {
        self.lock()
            .get_mut(&req.purpose)
            .and_then(VecDeque::pop_front)
            .ok_or_else(|| ModelError::CassetteExhausted {
                purpose: req.purpose.clone(),
            })
    }
}
