//! The `Client`: one account (server, organisation) with its cache, its token provider and its device signer, and
//! the sub-clients that share them.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use loams_proto::connect::{ConnectClient, ConnectError, ConnectMessage};
use tokio::sync::mpsc;

use crate::approvals::Approvals;
use crate::bot::Bot;
use crate::cache::Cache;
use crate::devices::Devices;
use crate::error::{Error, Result};
use crate::panels::Panels;
use crate::runs::Runs;
use crate::signer::{self, DeviceSigner};
use crate::types::Device;

/// Longest server URL accepted.
const MAX_URL: usize = 2048;
/// Longest bearer token accepted from the platform.
const MAX_TOKEN: usize = 16 * 1024;
const MAX_ORG: usize = 63;
/// Stream items buffered between the reading task and the watch.
const STREAM_BUFFER: usize = 64;

/// Gives the core a bearer token for the server; the platform implements it (its OIDC session, refreshed as it
/// sees fit). Called before every request, so a refreshed token is picked up at once.
#[async_trait]
pub trait TokenProvider: Send + Sync {
    async fn access_token(&self) -> Result<String>;
}

/// How a watch follows a run after its snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// The WatchRun server stream; falls back to polling when the server (or a proxy) cannot stream.
    Stream,
    /// Always poll GetRun + GetTimeline from the cursor.
    Poll,
}

#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// e.g. `https://loams.example.com`; the Connect services are under it.
    pub server_url: String,
    /// The organisation the account belongs to (`^[a-z0-9][a-z0-9-]{0,62}$`).
    pub org: String,
    /// The SQLite file of this account (created if missing).
    pub database_path: PathBuf,
    pub sync_mode: SyncMode,
    /// Pause between polls in `SyncMode::Poll` (and the polling fallback).
    pub poll_interval: Duration,
    /// Deadline of each unary call; also how long "can the server be reached" may take.
    pub request_timeout: Duration,
    /// How long a watch waits before reconnecting after the connection dropped.
    pub reconnect_delay: Duration,
}

impl ClientConfig {
    pub fn new(
        server_url: impl Into<String>,
        org: impl Into<String>,
        database_path: impl Into<PathBuf>,
    ) -> Self {
        ClientConfig {
            server_url: server_url.into(),
            org: org.into(),
            database_path: database_path.into(),
            sync_mode: SyncMode::Stream,
            poll_interval: Duration::from_secs(2),
            request_timeout: Duration::from_secs(15),
            reconnect_delay: Duration::from_secs(1),
        }
    }
}

pub(crate) struct Inner {
    pub(crate) config: ClientConfig,
    pub(crate) cache: Cache,
    pub(crate) signer: Arc<dyn DeviceSigner>,
    tokens: Arc<dyn TokenProvider>,
    /// Built on the first request: its TLS setup (root store, rustls configuration) is most of what opening a
    /// client would otherwise cost, and an app launch shows the cache before it needs the network.
    http: OnceLock<reqwest::Client>,
    network: AtomicBool,
}

/// One account on one server. Cheap to clone; the sub-clients share it.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn valid_org(org: &str) -> bool {
    let b = org.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_ORG
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

impl Client {
    /// Opens the account's cache (migrating it); makes no request (the HTTP client is built on the first one).
    pub fn new(
        config: ClientConfig,
        tokens: Arc<dyn TokenProvider>,
        signer: Arc<dyn DeviceSigner>,
    ) -> Result<Client> {
        let url = config.server_url.trim_end_matches('/').to_owned();
        if url.len() > MAX_URL || !(url.starts_with("https://") || url.starts_with("http://")) {
            return Err(Error::InvalidInput(
                "server_url must be an http(s) URL of at most 2048 bytes".into(),
            ));
        }
        if !valid_org(&config.org) {
            return Err(Error::InvalidInput(
                "org must match ^[a-z0-9][a-z0-9-]{0,62}$".into(),
            ));
        }
        let cache = Cache::open(&config.database_path, &url, &config.org)?;
        let config = ClientConfig {
            server_url: url,
            ..config
        };
        Ok(Client {
            inner: Arc::new(Inner {
                config,
                cache,
                signer,
                tokens,
                http: OnceLock::new(),
                network: AtomicBool::new(true),
            }),
        })
    }

    pub fn runs(&self) -> Runs {
        Runs::new(self.inner.clone())
    }

    pub fn approvals(&self) -> Approvals {
        Approvals::new(self.inner.clone())
    }

    pub fn devices(&self) -> Devices {
        Devices::new(self.inner.clone())
    }

    pub fn bot(&self) -> Bot {
        Bot::new(self.inner.clone())
    }

    pub fn panels(&self) -> Panels {
        Panels::new(self.inner.clone())
    }

    /// The platform's network monitor (NWPathMonitor, ConnectivityManager) reports here. While `false`, every
    /// request fails at once with [`Error::Offline`] without trying, and watches wait instead of retrying.
    pub fn set_network_available(&self, available: bool) {
        self.inner.network.store(available, Ordering::SeqCst);
    }

    pub fn org(&self) -> String {
        self.inner.config.org.clone()
    }
}

/// The server's challenges are 32 bytes; an empty or much larger one is not the server's.
const MAX_CHALLENGE: usize = 1024;

impl Inner {
    /// This installation's registered, unrevoked device: the one that signs decisions and kills (works offline).
    pub(crate) fn signing_device(&self) -> Result<Device> {
        let device = self.cache.device()?.ok_or(Error::NotRegistered)?;
        if device.revoked_at_ms != 0 {
            return Err(Error::NotRegistered);
        }
        Ok(device)
    }

    /// Signs the canonical bytes of a signed step (a decision, a kill) over `challenge`. The signature is checked
    /// against the registered key, so a platform key that changed since registration is caught here, not by the
    /// server.
    pub(crate) async fn sign_step(
        &self,
        device: &Device,
        challenge: &[u8],
        bytes: Vec<u8>,
    ) -> Result<Vec<u8>> {
        if challenge.is_empty() || challenge.len() > MAX_CHALLENGE {
            return Err(Error::Server("the server sent no usable challenge".into()));
        }
        let signature = self.signer.sign(bytes.clone()).await?;
        signer::verify(&device.public_key, &bytes, &signature)?;
        Ok(signature)
    }

    fn http(&self) -> Result<reqwest::Client> {
        if let Some(http) = self.http.get() {
            return Ok(http.clone());
        }
        let built = reqwest::Client::builder()
            // A server that does not answer the connection is offline: say so quickly instead of hanging a tap.
            .connect_timeout(self.config.request_timeout.min(Duration::from_secs(5)))
            .build()
            .map_err(|e| Error::InvalidInput(format!("HTTP client: {e}")))?;
        // Two first requests at once may both build one; the first stored is the one every request shares.
        Ok(self.http.get_or_init(|| built).clone())
    }

    pub(crate) fn network_available(&self) -> bool {
        self.network.load(Ordering::SeqCst)
    }

    /// A Connect client carrying the current token. Fails fast when the platform says there is no network.
    async fn connect(&self) -> Result<ConnectClient> {
        if !self.network_available() {
            return Err(Error::Offline("no network connection".into()));
        }
        let token = self.tokens.access_token().await?;
        if token.is_empty() || token.len() > MAX_TOKEN {
            return Err(Error::Unauthenticated(
                "the token provider returned no usable token".into(),
            ));
        }
        ConnectClient::with_http_client(self.http()?, self.config.server_url.clone())
            .with_header("authorization", format!("Bearer {token}"))
            .map_err(|_| Error::Unauthenticated("the token is not a valid header value".into()))
    }

    pub(crate) async fn unary<Req: ConnectMessage, Resp: ConnectMessage>(
        &self,
        path: &str,
        req: &Req,
    ) -> Result<Resp> {
        let client = self
            .connect()
            .await?
            .with_timeout(self.config.request_timeout);
        Ok(client.unary(path, req).await?)
    }

    /// A server stream without a deadline (the server bounds its length); errors stay Connect errors so that the
    /// caller can tell "cannot stream here" (`unimplemented`) from "offline".
    ///
    /// The items come through a channel from a task that owns the Connect client: the stream type of
    /// `ConnectClient::server_stream` borrows its arguments under edition 2024's capture rules, so it cannot outlive
    /// this call. The task ends with the stream or as soon as the receiver is dropped.
    pub(crate) async fn server_stream<Req: ConnectMessage + Clone, Resp: ConnectMessage>(
        &self,
        path: &str,
        req: &Req,
    ) -> Result<ItemStream<Resp>> {
        let client = self.connect().await?;
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let (path, req) = (path.to_owned(), req.clone());
        tokio::spawn(async move {
            let stream = client.server_stream::<Req, Resp>(&path, &req);
            futures::pin_mut!(stream);
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    item = stream.next() => match item {
                        Some(item) => if tx.send(item).await.is_err() { return },
                        None => return,
                    },
                }
            }
        });
        Ok(ItemStream { rx, held: None })
    }
}

/// Most items a watch stores in one transaction: a long burst is split so that readers of the cache (the UI) wait
/// for no more than one batch.
const STREAM_BATCH: usize = 1_000;

/// The items of a server stream, as `Inner::server_stream` passes them on.
pub(crate) struct ItemStream<T> {
    rx: mpsc::Receiver<Result<T, ConnectError>>,
    /// An item looked at by `burst` but not taken: the next `recv` returns it.
    held: Option<Result<T, ConnectError>>,
}

impl<T> ItemStream<T> {
    /// The next item; `None` when the stream has ended.
    pub(crate) async fn recv(&mut self) -> Option<Result<T, ConnectError>> {
        match self.held.take() {
            Some(item) => Some(item),
            None => self.rx.recv().await,
        }
    }

    /// `first` and the items behind it that have already arrived and that `take` goes on with (it breaks off with
    /// the item it refuses), at most [`STREAM_BATCH`] in all: a watch stores a burst in one transaction without
    /// waiting for more. The refused item, or an error, is returned by the next `recv`.
    pub(crate) fn burst<U>(
        &mut self,
        first: U,
        mut take: impl FnMut(T) -> ControlFlow<T, U>,
    ) -> Vec<U> {
        let mut batch = vec![first];
        while batch.len() < STREAM_BATCH {
            let Some(item) = self.held.take().or_else(|| self.rx.try_recv().ok()) else {
                break;
            };
            match item.map(&mut take) {
                Ok(ControlFlow::Continue(taken)) => batch.push(taken),
                Ok(ControlFlow::Break(refused)) => {
                    self.held = Some(Ok(refused));
                    break;
                }
                Err(e) => {
                    self.held = Some(Err(e));
                    break;
                }
            }
        }
        batch
    }
}

/// A running subscription. Dropping it, or `cancel()`, stops it: the platform keeps it as long as the screen wants
/// updates.
pub struct TaskHandle {
    handle: tokio::task::JoinHandle<()>,
    ending: Ending,
}

impl TaskHandle {
    /// Starts `task` on tokio, handing it the `Ending` to mark before its last delivery if it can end by itself.
    pub(crate) fn spawn<F>(task: impl FnOnce(Ending) -> F) -> TaskHandle
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let ending = Ending::default();
        let handle = tokio::spawn(task(ending.clone()));
        TaskHandle { handle, ending }
    }

    pub fn cancel(&self) {
        self.handle.abort();
    }

    /// True once the watch has ended by itself, from just before its last delivery (so a listener told `Finished`
    /// can ask and get true), or once it has stopped after `cancel()`.
    pub fn is_finished(&self) -> bool {
        self.ending.is_marked() || self.handle.is_finished()
    }
}

/// Set by a watch's task just before its last delivery: the task itself ends a moment later, on another thread.
#[derive(Clone, Default)]
pub(crate) struct Ending(Arc<AtomicBool>);

impl Ending {
    pub(crate) fn mark(&self) {
        self.0.store(true, Ordering::Release);
    }

    fn is_marked(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl Drop for TaskHandle {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

/// Longest id (run, approval, thread, device) the core sends or accepts.
pub(crate) const MAX_ID: usize = 128;

/// Ids come from the UI, links and push payloads; refuse anything the server would refuse anyway, before a call.
pub(crate) fn check_id(what: &str, id: &str) -> Result<()> {
    if id.is_empty() || id.len() > MAX_ID || id.chars().any(char::is_control) {
        return Err(Error::InvalidInput(format!(
            "{what} must be 1..={MAX_ID} bytes without control characters"
        )));
    }
    Ok(())
}

/// A fresh idempotency key for a write: a retry of the same call reuses it, a new user action gets a new one.
pub(crate) fn idempotency_key(prefix: &str) -> Result<String> {
    let mut b = [0u8; 16];
    aws_lc_rs::rand::fill(&mut b).map_err(|_| Error::Signer("no randomness available".into()))?;
    Ok(format!("{prefix}-{}", hex::encode(b)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signer::SoftwareSigner;

    #[test]
    fn ids_are_checked_before_anything_is_sent() {
        assert!(check_id("run_id", "r-0123456789abcdef").is_ok());
        for bad in [String::new(), "r".repeat(MAX_ID + 1), "r-1\n".into()] {
            assert!(
                matches!(check_id("run_id", &bad), Err(Error::InvalidInput(_))),
                "{bad:?}"
            );
        }
    }

    struct NoToken;

    #[async_trait]
    impl TokenProvider for NoToken {
        async fn access_token(&self) -> Result<String> {
            Ok(String::new())
        }
    }

    fn config(url: &str, org: &str, dir: &std::path::Path) -> ClientConfig {
        ClientConfig::new(url, org, dir.join("core.db"))
    }

    #[tokio::test]
    async fn bad_settings_are_refused_and_an_empty_token_is_not_sent() {
        let dir = tempfile::tempdir().unwrap();
        let keys: Arc<keyring_core::CredentialStore> = keyring_core::mock::Store::new().unwrap();
        let signer: Arc<dyn DeviceSigner> =
            Arc::new(SoftwareSigner::load_or_create(&keys, "s", "a").unwrap());
        let new = |c| Client::new(c, Arc::new(NoToken), signer.clone());
        assert!(matches!(
            new(config("ftp://x", "acme", dir.path())),
            Err(Error::InvalidInput(_))
        ));
        assert!(matches!(
            new(config("http://x", "Acme", dir.path())),
            Err(Error::InvalidInput(_))
        ));
        let long = format!("https://{}", "a".repeat(MAX_URL));
        assert!(matches!(
            new(config(&long, "acme", dir.path())),
            Err(Error::InvalidInput(_))
        ));
        // Port 9 (discard) on localhost: nothing is sent anyway, the empty token stops the call first.
        let client = new(config("http://127.0.0.1:9/", "acme", dir.path())).unwrap();
        assert!(matches!(
            client.runs().refresh().await,
            Err(Error::Unauthenticated(_))
        ));
        // A kill is signed by the device: without one registered, nothing is sent.
        assert!(matches!(
            client.runs().kill("r-1", "").await,
            Err(Error::NotRegistered)
        ));
        assert!(matches!(
            client.runs().kill("", "").await,
            Err(Error::InvalidInput(_))
        ));
        assert!(matches!(
            client.runs().kill("r-1", &"x".repeat(501)).await,
            Err(Error::InvalidInput(_))
        ));
        for hidden in ["stop\u{1b}[2J", "stop \u{202E}dnuof"] {
            assert!(matches!(
                client.runs().kill("r-1", hidden).await,
                Err(Error::InvalidInput(_))
            ));
        }
        assert!(matches!(
            client
                .approvals()
                .decide("a-1", crate::Decision::Approve, None)
                .await,
            Err(Error::NotRegistered)
        ));
        // An oversized phrase is refused before anything else, device key and network included.
        client.set_network_available(false);
        assert!(matches!(
            client
                .approvals()
                .decide("a-1", crate::Decision::Approve, Some("x".repeat(257)))
                .await,
            Err(Error::InvalidInput(_))
        ));
    }

    #[tokio::test]
    async fn burst_takes_only_arrived_items_that_it_accepts_and_keeps_the_rest_in_order() {
        let (tx, rx) = mpsc::channel(8);
        let mut stream = ItemStream { rx, held: None };
        let even = |n: u32| {
            if n.is_multiple_of(2) {
                ControlFlow::Continue(n)
            } else {
                ControlFlow::Break(n)
            }
        };
        for n in [2, 4, 5] {
            tx.send(Ok(n)).await.unwrap();
        }
        tx.send(Err(ConnectError::unavailable("cut")))
            .await
            .unwrap();
        assert_eq!(stream.burst(0, even), [0, 2, 4], "5 is refused");
        assert_eq!(stream.burst(0, even), [0], "and stays refused");
        assert_eq!(stream.recv().await.unwrap().unwrap(), 5, "then received");
        assert_eq!(stream.burst(0, even), [0], "an error is never taken");
        assert!(stream.recv().await.unwrap().is_err());
        assert_eq!(stream.burst(0, even), [0], "nothing has arrived");
        drop(tx);
        assert!(stream.recv().await.is_none());
    }

    #[tokio::test]
    async fn a_burst_stops_at_the_batch_size() {
        let (tx, rx) = mpsc::channel(STREAM_BATCH);
        let mut stream = ItemStream { rx, held: None };
        for n in 1..=STREAM_BATCH {
            tx.send(Ok(n)).await.unwrap();
        }
        let batch = stream.burst(0, ControlFlow::Continue);
        assert_eq!(batch.len(), STREAM_BATCH);
        assert_eq!(batch.last(), Some(&(STREAM_BATCH - 1)));
        assert_eq!(
            stream.recv().await.unwrap().unwrap(),
            STREAM_BATCH,
            "the rest waits"
        );
    }

    #[test]
    fn org_names() {
        assert!(valid_org("acme"));
        assert!(valid_org("0-a"));
        assert!(!valid_org(""));
        assert!(!valid_org("-a"));
        assert!(!valid_org("Acme"));
        assert!(!valid_org(&"a".repeat(64)));
    }
}
