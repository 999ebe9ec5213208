//! The optional state file: JSON, rewritten atomically (temp file + rename) after each change.

use crate::{Result, SandboxError, State};
use std::path::Path;

/// A state file larger than this is refused rather than read into memory.
const MAX_STATE_BYTES: u64 = 64 * 1024 * 1024;

pub(crate) fn load(path: &Path) -> Result<Option<State>> {
    let err = |message: String| SandboxError::State {
        path: path.into(),
        message,
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(err(e.to_string())),
    };
    if meta.len() > MAX_STATE_BYTES {
        return Err(err(format!("larger than {MAX_STATE_BYTES} bytes")));
    }
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| err(format!("not a sandbox state: {e}")))
}

pub(crate) fn save(path: &Path, state: &State) -> Result<()> {
    let err = |message: String| SandboxError::State {
        path: path.into(),
        message,
    };
    let bytes = serde_json::to_vec(state).map_err(|e| err(e.to_string()))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, bytes).map_err(|e| err(e.to_string()))?;
    // rename is atomic on one filesystem, so a crash never leaves a half-written state file
    std::fs::rename(&tmp, path).map_err(|e| err(e.to_string()))
}
