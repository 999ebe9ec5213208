//! The loop behind every watch that follows a server stream (runs, bot threads): stream from the stored cursor,
//! fall back to polling where streaming is not available, wait out a missing network, and report connection changes.

use std::future::Future;
use std::sync::Arc;

use crate::client::{Ending, Inner, SyncMode};
use crate::error::{Error, Result};

/// How one stream connection, or one poll, ended.
pub(crate) enum Step {
    /// Everything there is to follow is stored: the watch ends.
    Finished,
    /// Go on: reconnect from the cursor, or poll again.
    Again,
    /// The server or a proxy cannot stream: poll instead.
    Unsupported,
}

/// Tells the listener the connection state; the loop passes on only transitions. The detail is borrowed because a
/// stream reports on every item and only a transition needs it as an owned string.
pub(crate) type Report<'a> = dyn FnMut(bool, &str) + Send + 'a;

/// What one kind of watch does; `follow` runs it.
pub(crate) trait Follower: Send + Sync {
    /// Delivers a connection change to the listener.
    fn connection(&self, connected: bool, detail: String);
    /// One stream connection from the stored cursor, delivering what is new.
    fn stream_once(
        &self,
        inner: &Inner,
        report: &mut Report<'_>,
    ) -> impl Future<Output = Result<Step>> + Send;
    /// One poll, delivering what is new.
    fn poll_once(
        &self,
        inner: &Inner,
        report: &mut Report<'_>,
    ) -> impl Future<Output = Result<Step>> + Send;
    /// Called once when a step returned `Step::Finished`, before the watch ends.
    fn finished(&self) {}
}

/// Follows until a step finishes, an error retrying cannot help, or the task is aborted; `ending` is marked before
/// the last delivery of a watch that ends by itself.
pub(crate) async fn follow(inner: Arc<Inner>, follower: impl Follower, ending: Ending) {
    let mut mode = inner.config.sync_mode;
    // Only transitions are reported, so a flapping network does not flood the UI.
    let mut connected: Option<bool> = None;
    let mut report = |ok: bool, detail: &str| {
        if connected != Some(ok) {
            connected = Some(ok);
            follower.connection(ok, detail.to_owned());
        }
    };
    loop {
        if !inner.network_available() {
            report(false, "no network connection");
            tokio::time::sleep(inner.config.reconnect_delay).await;
            continue;
        }
        let outcome = match mode {
            SyncMode::Stream => follower.stream_once(&inner, &mut report).await,
            SyncMode::Poll => follower.poll_once(&inner, &mut report).await,
        };
        match outcome {
            Ok(Step::Finished) => {
                ending.mark();
                follower.finished();
                return;
            }
            Ok(Step::Again) if mode == SyncMode::Poll => {
                tokio::time::sleep(inner.config.poll_interval).await
            }
            // A pause even after a clean close, so a proxy that cuts every stream at once cannot make this spin.
            Ok(Step::Again) => tokio::time::sleep(inner.config.reconnect_delay).await,
            Ok(Step::Unsupported) => {
                mode = SyncMode::Poll;
                report(true, "streaming unavailable; polling");
            }
            Err(
                e @ (Error::NotFound(_) | Error::PermissionDenied(_) | Error::Unauthenticated(_)),
            ) => {
                // Retrying cannot help; the screen shows the cache and the reason. Delivered even after an earlier
                // "disconnected" (which `report` would not repeat): it is the watch's last word.
                ending.mark();
                follower.connection(false, e.to_string());
                return;
            }
            Err(e) => {
                report(false, &e.to_string());
                tokio::time::sleep(inner.config.reconnect_delay).await;
            }
        }
    }
}
