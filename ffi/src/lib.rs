//! The UniFFI facade over `loams-core` (DESIGN.md section 8): what the SwiftUI and Compose apps call.
//!
//! Shape (after matrix-rust-sdk's `matrix-sdk-ffi`): objects are thin newtypes over the core's client and
//! sub-clients; the core's plain records and enums cross as they are (declared here as UniFFI remote types, so the
//! core needs no UniFFI dependency); async methods run on tokio; the platform implements the foreign traits
//! [`DeviceSigner`], [`TokenProvider`] and the listeners; a watch delivers its snapshot before it returns and then
//! changes, and hands back a [`TaskHandle`] that stops it when cancelled or dropped.

mod records;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use loams_core as core;

pub use loams_core::{
    AllowedApp, App, Approval, ApprovalState, ApprovalUpdate, Budget, ChatMessage, ChatThread,
    CheckRun, CheckRuns, Decision, Device, ErrorIssue, Issue, LinkTemplate, Message, MetricPoint,
    MetricSeries, PullRequest, Risk, Route, Run, RunLinks, RunSync, RunUpdate, Signal, SyncMode,
    Thread, ThreadUpdate, TimelineEvent,
};

uniffi::setup_scaffolding!();

/// Longest list a foreign caller may ask for in one call; bounds what crosses the FFI in one buffer.
const MAX_LIMIT: u32 = 10_000;
/// Longest allowlist accepted with a link or push payload (the registry lists a few dozen apps).
const MAX_ALLOWLIST: usize = 1_000;

/// The errors of every call: the core's own small, flat enum, plus what a failing platform callback becomes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, uniffi::Error)]
pub enum LoamsError {
    /// The server could not be reached, or the platform said there is no network. Nothing was queued and the
    /// cache is unchanged.
    #[error("offline: {detail}")]
    Offline { detail: String },
    #[error("not signed in: {detail}")]
    Unauthenticated { detail: String },
    #[error("permission denied: {detail}")]
    PermissionDenied { detail: String },
    #[error("not found: {detail}")]
    NotFound { detail: String },
    #[error("refused: {detail}")]
    Rejected { detail: String },
    /// The typed confirmation of a destructive approval does not match `phrase`; nothing was sent.
    #[error("the typed confirmation does not match the phrase {phrase:?}")]
    ConfirmationMismatch { phrase: String },
    #[error("this device is not registered")]
    NotRegistered,
    /// The platform signer or key store failed (or the signature does not verify with the registered key).
    #[error("device key: {detail}")]
    Signer { detail: String },
    #[error("cache: {detail}")]
    Cache { detail: String },
    #[error("invalid input: {detail}")]
    InvalidInput { detail: String },
    #[error("link not allowed: {detail}")]
    NotAllowed { detail: String },
    #[error("server error: {detail}")]
    Server { detail: String },
    /// A platform callback threw something it did not declare.
    #[error("platform callback failed: {detail}")]
    Platform { detail: String },
}

impl From<core::Error> for LoamsError {
    fn from(e: core::Error) -> Self {
        use core::Error as E;
        match e {
            E::Offline(detail) => LoamsError::Offline { detail },
            E::Unauthenticated(detail) => LoamsError::Unauthenticated { detail },
            E::PermissionDenied(detail) => LoamsError::PermissionDenied { detail },
            E::NotFound(detail) => LoamsError::NotFound { detail },
            E::Rejected(detail) => LoamsError::Rejected { detail },
            E::ConfirmationMismatch { phrase } => LoamsError::ConfirmationMismatch { phrase },
            E::NotRegistered => LoamsError::NotRegistered,
            E::Signer(detail) => LoamsError::Signer { detail },
            E::Cache(detail) => LoamsError::Cache { detail },
            E::InvalidInput(detail) => LoamsError::InvalidInput { detail },
            E::NotAllowed(detail) => LoamsError::NotAllowed { detail },
            E::Server(detail) => LoamsError::Server { detail },
        }
    }
}

/// What a platform callback's error means to the core. A platform failure in the signer is a signer error, in the
/// token provider a sign-in error (the caller passes which).
fn into_core(e: LoamsError, platform: fn(String) -> core::Error) -> core::Error {
    use core::Error as E;
    match e {
        LoamsError::Offline { detail } => E::Offline(detail),
        LoamsError::Unauthenticated { detail } => E::Unauthenticated(detail),
        LoamsError::PermissionDenied { detail } => E::PermissionDenied(detail),
        LoamsError::NotFound { detail } => E::NotFound(detail),
        LoamsError::Rejected { detail } => E::Rejected(detail),
        LoamsError::ConfirmationMismatch { phrase } => E::ConfirmationMismatch { phrase },
        LoamsError::NotRegistered => E::NotRegistered,
        LoamsError::Signer { detail } => E::Signer(detail),
        LoamsError::Cache { detail } => E::Cache(detail),
        LoamsError::InvalidInput { detail } => E::InvalidInput(detail),
        LoamsError::NotAllowed { detail } => E::NotAllowed(detail),
        LoamsError::Server { detail } => E::Server(detail),
        LoamsError::Platform { detail } => platform(detail),
    }
}

impl From<uniffi::UnexpectedUniFFICallbackError> for LoamsError {
    fn from(e: uniffi::UnexpectedUniFFICallbackError) -> Self {
        LoamsError::Platform { detail: e.reason }
    }
}

type Result<T, E = LoamsError> = std::result::Result<T, E>;

fn limit(limit: u32) -> Result<u32> {
    if limit > MAX_LIMIT {
        return Err(LoamsError::InvalidInput {
            detail: format!("limit must be at most {MAX_LIMIT}"),
        });
    }
    Ok(limit)
}

// ---- foreign traits ----------------------------------------------------------------------------------------------

/// The device key, held by the platform (Secure Enclave, StrongBox or TEE). Async so that the platform may show
/// Face ID or a BiometricPrompt before signing.
#[uniffi::export(foreign)]
#[async_trait]
pub trait DeviceSigner: Send + Sync {
    /// The public key as an uncompressed P-256 point (65 bytes, 0x04 || X || Y).
    async fn public_key(&self) -> Result<Vec<u8>>;
    /// ECDSA P-256 with SHA-256 over `message`, ASN.1 DER encoded.
    async fn sign(&self, message: Vec<u8>) -> Result<Vec<u8>>;
}

/// The platform's sign-in session: a current bearer token, asked for before every request.
#[uniffi::export(foreign)]
#[async_trait]
pub trait TokenProvider: Send + Sync {
    async fn access_token(&self) -> Result<String>;
}

/// Receives a run watch's updates, on a background thread (the UI hops to its main thread).
#[uniffi::export(foreign)]
pub trait RunListener: Send + Sync {
    fn on_update(&self, update: RunUpdate);
}

#[uniffi::export(foreign)]
pub trait ApprovalListener: Send + Sync {
    fn on_update(&self, update: ApprovalUpdate);
}

#[uniffi::export(foreign)]
pub trait ThreadListener: Send + Sync {
    fn on_update(&self, update: ThreadUpdate);
}

struct Signer(Arc<dyn DeviceSigner>);

#[async_trait]
impl core::DeviceSigner for Signer {
    async fn public_key(&self) -> core::Result<Vec<u8>> {
        self.0
            .public_key()
            .await
            .map_err(|e| into_core(e, core::Error::Signer))
    }

    async fn sign(&self, message: Vec<u8>) -> core::Result<Vec<u8>> {
        self.0
            .sign(message)
            .await
            .map_err(|e| into_core(e, core::Error::Signer))
    }
}

struct Tokens(Arc<dyn TokenProvider>);

#[async_trait]
impl core::TokenProvider for Tokens {
    async fn access_token(&self) -> core::Result<String> {
        self.0
            .access_token()
            .await
            .map_err(|e| into_core(e, core::Error::Unauthenticated))
    }
}

struct Listener<L: ?Sized>(Arc<L>);

impl core::RunListener for Listener<dyn RunListener> {
    fn on_update(&self, update: RunUpdate) {
        self.0.on_update(update)
    }
}

impl core::ApprovalListener for Listener<dyn ApprovalListener> {
    fn on_update(&self, update: ApprovalUpdate) {
        self.0.on_update(update)
    }
}

impl core::ThreadListener for Listener<dyn ThreadListener> {
    fn on_update(&self, update: ThreadUpdate) {
        self.0.on_update(update)
    }
}

// ---- objects -----------------------------------------------------------------------------------------------------

/// A running watch. `cancel()` or dropping it (the foreign object being freed) stops it.
#[derive(uniffi::Object)]
pub struct TaskHandle(core::TaskHandle);

#[uniffi::export]
impl TaskHandle {
    pub fn cancel(&self) {
        self.0.cancel()
    }

    /// True from just before a watch's last delivery when it ends by itself (`Finished`, or the error that ends
    /// it), or once it has stopped after `cancel()`.
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

/// How the client is set up; durations in milliseconds.
#[derive(Clone, Debug, uniffi::Record)]
pub struct ClientSettings {
    pub server_url: String,
    pub org: String,
    /// The account's SQLite file in the app's data directory (created if missing).
    pub database_path: String,
    pub sync_mode: SyncMode,
    #[uniffi(default = 2000)]
    pub poll_interval_ms: u64,
    #[uniffi(default = 15000)]
    pub request_timeout_ms: u64,
    #[uniffi(default = 1000)]
    pub reconnect_delay_ms: u64,
}

/// One account on one server; the sub-clients share its cache, token provider and signer.
#[derive(uniffi::Object)]
pub struct Client(core::Client);

#[uniffi::export]
impl Client {
    /// Opens (and migrates) the account's cache; makes no request.
    #[uniffi::constructor]
    pub fn new(
        settings: ClientSettings,
        tokens: Arc<dyn TokenProvider>,
        signer: Arc<dyn DeviceSigner>,
    ) -> Result<Arc<Client>> {
        let mut config =
            core::ClientConfig::new(settings.server_url, settings.org, settings.database_path);
        config.sync_mode = settings.sync_mode;
        config.poll_interval = Duration::from_millis(settings.poll_interval_ms);
        config.request_timeout = Duration::from_millis(settings.request_timeout_ms);
        config.reconnect_delay = Duration::from_millis(settings.reconnect_delay_ms);
        let client = core::Client::new(config, Arc::new(Tokens(tokens)), Arc::new(Signer(signer)))?;
        Ok(Arc::new(Client(client)))
    }

    pub fn runs(&self) -> Arc<Runs> {
        Arc::new(Runs(self.0.runs()))
    }

    pub fn approvals(&self) -> Arc<Approvals> {
        Arc::new(Approvals(self.0.approvals()))
    }

    pub fn devices(&self) -> Arc<Devices> {
        Arc::new(Devices(self.0.devices()))
    }

    pub fn bot(&self) -> Arc<Bot> {
        Arc::new(Bot(self.0.bot()))
    }

    pub fn panels(&self) -> Arc<Panels> {
        Arc::new(Panels(self.0.panels()))
    }

    /// The platform's network monitor reports here; while false every request fails at once with `Offline`.
    pub fn set_network_available(&self, available: bool) {
        self.0.set_network_available(available)
    }

    pub fn org(&self) -> String {
        self.0.org()
    }
}

#[derive(uniffi::Object)]
pub struct Runs(core::Runs);

#[uniffi::export(async_runtime = "tokio")]
impl Runs {
    /// Cached runs, newest first (works offline; `confirmed_at_ms` says how fresh).
    pub fn cached(&self, limit: u32) -> Result<Vec<Run>> {
        Ok(self.0.cached(self::limit(limit)?)?)
    }

    pub fn cached_run(&self, run_id: String) -> Result<Option<Run>> {
        Ok(self.0.cached_run(&run_id)?)
    }

    pub fn cached_timeline(
        &self,
        run_id: String,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<TimelineEvent>> {
        Ok(self
            .0
            .cached_timeline(&run_id, after_seq, self::limit(limit)?)?)
    }

    pub async fn refresh(&self) -> Result<Vec<Run>> {
        Ok(self.0.refresh().await?)
    }

    pub async fn sync(&self, run_id: String) -> Result<RunSync> {
        Ok(self.0.sync(&run_id).await?)
    }

    pub async fn kill(&self, run_id: String, reason: String) -> Result<Run> {
        Ok(self.0.kill(&run_id, &reason).await?)
    }

    /// Delivers the cached snapshot before returning, then the server's changes until the run ends, the server
    /// refuses the watch (a last `Connection` notice gives the reason), or the handle is cancelled or dropped.
    pub async fn watch(
        &self,
        run_id: String,
        listener: Arc<dyn RunListener>,
    ) -> Result<Arc<TaskHandle>> {
        let handle = self.0.watch(&run_id, Arc::new(Listener(listener))).await?;
        Ok(Arc::new(TaskHandle(handle)))
    }
}

#[derive(uniffi::Object)]
pub struct Approvals(core::Approvals);

#[uniffi::export(async_runtime = "tokio")]
impl Approvals {
    pub fn cached_pending(&self, limit: u32) -> Result<Vec<Approval>> {
        Ok(self.0.cached_pending(self::limit(limit)?)?)
    }

    pub fn cached(&self, approval_id: String) -> Result<Option<Approval>> {
        Ok(self.0.cached(&approval_id)?)
    }

    pub async fn refresh_pending(&self) -> Result<Vec<Approval>> {
        Ok(self.0.refresh_pending().await?)
    }

    pub async fn get(&self, approval_id: String) -> Result<Approval> {
        Ok(self.0.get(&approval_id).await?)
    }

    /// Signs the canonical decision bytes with the device key and sends the decision; `typed_confirmation` is the
    /// phrase a destructive approval asks for. Offline it fails at once and the cache is unchanged.
    pub async fn decide(
        &self,
        approval_id: String,
        decision: Decision,
        typed_confirmation: Option<String>,
    ) -> Result<Approval> {
        Ok(self
            .0
            .decide(&approval_id, decision, typed_confirmation)
            .await?)
    }

    /// Decides `shown`, a copy of the approval as the person saw it (from `get`, a watch or the cache), without
    /// reading it again. The shown action must hash to the shown action hash, which is what is signed (the summary
    /// and the risk are not); the server checks that hash against its own record. Offline it fails at once.
    pub async fn decide_shown(
        &self,
        shown: Approval,
        decision: Decision,
        typed_confirmation: Option<String>,
    ) -> Result<Approval> {
        Ok(self
            .0
            .decide_shown(&shown, decision, typed_confirmation)
            .await?)
    }

    pub async fn watch_pending(
        &self,
        listener: Arc<dyn ApprovalListener>,
    ) -> Result<Arc<TaskHandle>> {
        let handle = self.0.watch_pending(Arc::new(Listener(listener))).await?;
        Ok(Arc::new(TaskHandle(handle)))
    }
}

/// A run's native panels, read through the server from the apps' agents as this person (never cached).
#[derive(uniffi::Object)]
pub struct Panels(core::Panels);

#[uniffi::export(async_runtime = "tokio")]
impl Panels {
    /// The deployment's apps, and which of them this person may read.
    pub async fn apps(&self) -> Result<Vec<App>> {
        Ok(self.0.apps().await?)
    }

    pub async fn issue(&self, run_id: String) -> Result<Issue> {
        Ok(self.0.issue(&run_id).await?)
    }

    pub async fn pull_request(&self, run_id: String) -> Result<PullRequest> {
        Ok(self.0.pull_request(&run_id).await?)
    }

    pub async fn check_runs(&self, run_id: String) -> Result<CheckRuns> {
        Ok(self.0.check_runs(&run_id).await?)
    }

    pub async fn thread(&self, run_id: String) -> Result<ChatThread> {
        Ok(self.0.thread(&run_id).await?)
    }

    pub async fn error_issue(&self, run_id: String) -> Result<ErrorIssue> {
        Ok(self.0.error_issue(&run_id).await?)
    }

    /// From `since_ms` (at most 90 days back; 0: a day before the run started).
    pub async fn metric_series(&self, run_id: String, since_ms: i64) -> Result<MetricSeries> {
        Ok(self.0.metric_series(&run_id, since_ms).await?)
    }
}

#[derive(uniffi::Object)]
pub struct Devices(core::Devices);

#[uniffi::export(async_runtime = "tokio")]
impl Devices {
    pub fn current(&self) -> Result<Option<Device>> {
        Ok(self.0.current()?)
    }

    /// Registers the signer's public key (idempotent for the same key).
    pub async fn register(&self, name: String, push_token: Option<String>) -> Result<Device> {
        Ok(self.0.register(&name, push_token).await?)
    }

    pub async fn revoke(&self) -> Result<Device> {
        Ok(self.0.revoke().await?)
    }
}

#[derive(uniffi::Object)]
pub struct Bot(core::Bot);

#[uniffi::export(async_runtime = "tokio")]
impl Bot {
    pub fn cached_threads(&self, limit: u32) -> Result<Vec<Thread>> {
        Ok(self.0.cached_threads(self::limit(limit)?)?)
    }

    pub fn cached_messages(
        &self,
        thread_id: String,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<Message>> {
        Ok(self
            .0
            .cached_messages(&thread_id, after_seq, self::limit(limit)?)?)
    }

    pub async fn create_thread(&self, title: String) -> Result<Thread> {
        Ok(self.0.create_thread(&title).await?)
    }

    pub async fn send(&self, thread_id: String, content: String) -> Result<Message> {
        Ok(self.0.send(&thread_id, &content).await?)
    }

    pub async fn watch(
        &self,
        thread_id: String,
        listener: Arc<dyn ThreadListener>,
    ) -> Result<Arc<TaskHandle>> {
        let handle = self
            .0
            .watch(&thread_id, Arc::new(Listener(listener)))
            .await?;
        Ok(Arc::new(TaskHandle(handle)))
    }
}

// ---- functions ---------------------------------------------------------------------------------------------------

fn allowlist(allowlist: &[AllowedApp]) -> Result<()> {
    if allowlist.len() > MAX_ALLOWLIST {
        return Err(LoamsError::InvalidInput {
            detail: format!("the allowlist has more than {MAX_ALLOWLIST} apps"),
        });
    }
    Ok(())
}

/// Parses a `loams://` link into the screen it opens (a link only navigates).
#[uniffi::export]
pub fn parse_link(link: String, allowlist: Vec<AllowedApp>) -> Result<Route> {
    self::allowlist(&allowlist)?;
    Ok(core::parse_link(&link, &allowlist)?)
}

/// Parses a push payload (APNs / FCM data, JSON) into the screen it opens.
#[uniffi::export]
pub fn parse_push(payload: String, org: String, allowlist: Vec<AllowedApp>) -> Result<Route> {
    self::allowlist(&allowlist)?;
    Ok(core::parse_push(&payload, &org, &allowlist)?)
}

/// The cheapest call there is: what the FFI benchmarks time (one round trip with a small string each way).
#[uniffi::export]
pub fn echo(value: String) -> String {
    value
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    struct FailingPlatform;

    #[async_trait]
    impl DeviceSigner for FailingPlatform {
        async fn public_key(&self) -> Result<Vec<u8>> {
            Err(LoamsError::Platform {
                detail: "Keystore locked".into(),
            })
        }
        async fn sign(&self, _: Vec<u8>) -> Result<Vec<u8>> {
            Err(LoamsError::Offline {
                detail: "typed errors pass through".into(),
            })
        }
    }

    #[async_trait]
    impl TokenProvider for FailingPlatform {
        async fn access_token(&self) -> Result<String> {
            Err(LoamsError::Platform {
                detail: "session expired".into(),
            })
        }
    }

    #[derive(Default)]
    struct Seen(Mutex<Vec<RunUpdate>>);

    impl RunListener for Seen {
        fn on_update(&self, update: RunUpdate) {
            self.0.lock().unwrap().push(update);
        }
    }

    fn settings(dir: &std::path::Path, url: &str) -> ClientSettings {
        ClientSettings {
            server_url: url.into(),
            org: "acme".into(),
            database_path: dir.join("core.db").display().to_string(),
            sync_mode: SyncMode::Stream,
            poll_interval_ms: 50,
            request_timeout_ms: 1000,
            reconnect_delay_ms: 50,
        }
    }

    #[tokio::test]
    async fn a_platform_failure_becomes_the_matching_core_error() {
        let signer = Signer(Arc::new(FailingPlatform));
        assert_eq!(
            core::DeviceSigner::public_key(&signer).await,
            Err(core::Error::Signer("Keystore locked".into()))
        );
        assert_eq!(
            core::DeviceSigner::sign(&signer, vec![1]).await,
            Err(core::Error::Offline("typed errors pass through".into()))
        );
        let tokens = Tokens(Arc::new(FailingPlatform));
        assert_eq!(
            core::TokenProvider::access_token(&tokens).await,
            Err(core::Error::Unauthenticated("session expired".into()))
        );
        let unexpected = LoamsError::from(uniffi::UnexpectedUniFFICallbackError::new("boom"));
        assert_eq!(
            unexpected,
            LoamsError::Platform {
                detail: "boom".into()
            }
        );
    }

    #[test]
    fn core_errors_keep_their_kind_and_detail() {
        assert_eq!(
            LoamsError::from(core::Error::ConfirmationMismatch {
                phrase: "merge #1".into()
            }),
            LoamsError::ConfirmationMismatch {
                phrase: "merge #1".into()
            }
        );
        assert_eq!(
            LoamsError::from(core::Error::NotRegistered),
            LoamsError::NotRegistered
        );
        let offline = LoamsError::from(core::Error::Offline("connection refused".into()));
        assert_eq!(offline.to_string(), "offline: connection refused");
    }

    #[tokio::test]
    async fn a_watch_delivers_its_snapshot_before_returning_and_stops_when_cancelled() {
        let dir = tempfile::tempdir().unwrap();
        // Port 9 (discard) on localhost: nothing answers, and the platform says the network is down anyway.
        let client = Client::new(
            settings(dir.path(), "http://127.0.0.1:9"),
            Arc::new(FailingPlatform),
            Arc::new(FailingPlatform),
        )
        .unwrap();
        client.set_network_available(false);
        let seen = Arc::new(Seen::default());
        let handle = client
            .runs()
            .watch("r-1".into(), seen.clone())
            .await
            .unwrap();
        assert_eq!(
            seen.0.lock().unwrap().first(),
            Some(&RunUpdate::Snapshot {
                run: None,
                events: vec![]
            })
        );
        assert!(!handle.is_finished());
        handle.cancel();
        // The task stops at its next await, on a runtime thread: up to five seconds on a busy machine.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !handle.is_finished() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(handle.is_finished());
        assert!(matches!(
            client.runs().sync("r-1".into()).await,
            Err(LoamsError::Offline { .. })
        ));
    }

    #[test]
    fn oversized_inputs_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            Client::new(
                settings(dir.path(), "ftp://x"),
                Arc::new(FailingPlatform),
                Arc::new(FailingPlatform)
            ),
            Err(LoamsError::InvalidInput { .. })
        ));
        let client = Client::new(
            settings(dir.path(), "http://127.0.0.1:9"),
            Arc::new(FailingPlatform),
            Arc::new(FailingPlatform),
        )
        .unwrap();
        assert!(client.runs().cached(MAX_LIMIT).unwrap().is_empty());
        assert!(matches!(
            client.runs().cached(MAX_LIMIT + 1),
            Err(LoamsError::InvalidInput { .. })
        ));
        let many = vec![
            AllowedApp {
                env: "e".into(),
                app: "a".into()
            };
            MAX_ALLOWLIST + 1
        ];
        assert!(matches!(
            parse_link("loams://runs/r-1".into(), many),
            Err(LoamsError::InvalidInput { .. })
        ));
        assert_eq!(
            parse_link("loams://runs/r-1".into(), vec![]),
            Ok(Route::Run {
                run_id: "r-1".into()
            })
        );
    }
}
