//! A phone in the terminal, on the phones' own core (`loams-core`): the same client, SQLite cache, software device
//! key, signed approval flow and run watch the SwiftUI and Compose apps use through `loams-ffi`. `loams phone`
//! (see `terminal.rs`) is its front end; `loams demo`, the end-to-end tests and the engine bench approve with it.

use std::any::Any;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, anyhow, bail};

use crate::stack::create_private_dir;
use async_trait::async_trait;
use keyring_core::api::{Credential, CredentialApi, CredentialStoreApi};
use keyring_core::{CredentialStore, Entry};
use loams_core::{
    Approval, Client, ClientConfig, Decision, Device, Error, Panels, Run, RunListener,
    SoftwareSigner, TaskHandle, TokenProvider,
};

/// The keyring service the device key is stored under; the account is the phone's account directory name.
const KEY_SERVICE: &str = "loams-phone";

/// One account (server, organisation) of a phone: its core client, cache and device key.
pub struct Phone {
    client: Client,
    /// Never read, only held: a throwaway phone's cache and key live in this temporary directory, which is
    /// removed when the phone is dropped.
    _scratch: Option<tempfile::TempDir>,
}

/// The bearer token `loams phone` was given: the core asks for it before every request.
struct StaticToken(String);

#[async_trait]
impl TokenProvider for StaticToken {
    async fn access_token(&self) -> loams_core::Result<String> {
        Ok(self.0.clone())
    }
}

impl Phone {
    /// Opens the account of `org` on `server_url` under `data_dir`: its cache (`<account>/cache.db`) and its device
    /// key (in `keys/`, created on first use). Makes no request.
    pub fn open(
        server_url: &str,
        org: &str,
        token: String,
        data_dir: &Path,
    ) -> anyhow::Result<Phone> {
        // The organisation becomes part of a path: nothing but a valid organisation name may reach the filesystem.
        loams_platform::limits::org(org).map_err(|e| anyhow!("setting `org`: {e}"))?;
        let account = account_name(server_url, org);
        let account_dir = data_dir.join(&account);
        owner_only_dir(&account_dir)?;
        let keys = FileStore::open(&data_dir.join("keys"))?;
        let signer = SoftwareSigner::load_or_create(&keys, KEY_SERVICE, &account)
            .context("loading the device key")?;
        let config = ClientConfig::new(server_url, org, account_dir.join("cache.db"));
        let client = Client::new(config, Arc::new(StaticToken(token)), Arc::new(signer))
            .with_context(|| format!("opening the phone's cache in {}", account_dir.display()))?;
        Ok(Phone {
            client,
            _scratch: None,
        })
    }

    /// A throwaway phone for the token's user (its cache and key in a temporary directory), with its device
    /// registered: the scripted approver of the kill-restart test and the engine bench.
    pub async fn register(api_url: &str, token: &str, name: &str) -> anyhow::Result<Phone> {
        let org = token_org(token)
            .ok_or_else(|| anyhow!("the token names no organisation (no `org` claim)"))?;
        let scratch = tempfile::tempdir().context("creating the phone's directory")?;
        let opened = Phone::open(api_url, &org, token.to_string(), scratch.path())?;
        let phone = Phone {
            _scratch: Some(scratch),
            ..opened
        };
        phone.register_device(name).await?;
        Ok(phone)
    }

    /// Registers this phone's device key for the token's user; an already registered key keeps its device.
    pub async fn register_device(&self, name: &str) -> loams_core::Result<Device> {
        self.client.devices().register(name, None).await
    }

    /// The registered device, as last confirmed by the server; `None` before `register_device`.
    pub fn device(&self) -> loams_core::Result<Option<Device>> {
        self.client.devices().current()
    }

    /// The pending approvals the token's user may decide, read from the server (and cached).
    pub async fn pending(&self) -> loams_core::Result<Vec<Approval>> {
        self.client.approvals().refresh_pending().await
    }

    /// The pending approvals as last read, for when the server cannot be reached.
    pub fn cached_pending(&self) -> loams_core::Result<Vec<Approval>> {
        self.client.approvals().cached_pending(u32::MAX)
    }

    /// One approval as the server renders it now.
    pub async fn approval(&self, approval_id: &str) -> loams_core::Result<Approval> {
        self.client.approvals().get(approval_id).await
    }

    /// Signs `decision` with the device key through the core's approval flow; approving a destructive action
    /// needs its confirmation phrase typed exactly.
    pub async fn decide_typed(
        &self,
        approval_id: &str,
        decision: Decision,
        typed_confirmation: Option<String>,
    ) -> loams_core::Result<Approval> {
        self.client
            .approvals()
            .decide(approval_id, decision, typed_confirmation)
            .await
    }

    /// Signs `decision` over the action of the approval as it was shown, without reading it again (see
    /// [`loams_core::Approvals::decide_shown`]).
    pub async fn decide_shown(
        &self,
        shown: &Approval,
        decision: Decision,
        typed_confirmation: Option<String>,
    ) -> loams_core::Result<Approval> {
        self.client
            .approvals()
            .decide_shown(shown, decision, typed_confirmation)
            .await
    }

    /// The scripted approver (demo, tests, bench): no person is at the keyboard, so it types the phrase the
    /// approval shows, as a person reading the screen would. The phrase comes from the cached copy when there is
    /// one, else from the core's refusal, which names it without having spent a challenge.
    pub async fn decide(&self, approval_id: &str, approve: bool) -> loams_core::Result<Approval> {
        let decision = if approve {
            Decision::Approve
        } else {
            Decision::Deny
        };
        let shown = self
            .client
            .approvals()
            .cached(approval_id)?
            .and_then(|a| a.confirmation_phrase);
        match self.decide_typed(approval_id, decision, shown).await {
            Err(Error::ConfirmationMismatch { phrase }) => {
                self.decide_typed(approval_id, decision, Some(phrase)).await
            }
            other => other,
        }
    }

    /// The run panels, read through the server as this phone's person.
    pub fn panels(&self) -> Panels {
        self.client.panels()
    }

    /// Stops a run with a step-up signed by the device key (the core gets the kill challenge, signs and sends).
    pub async fn kill(&self, run_id: &str, reason: &str) -> loams_core::Result<Run> {
        self.client.runs().kill(run_id, reason).await
    }

    /// Follows a run: the cached snapshot first, then the server's changes, until the run has ended.
    pub async fn watch(
        &self,
        run_id: &str,
        listener: Arc<dyn RunListener>,
    ) -> loams_core::Result<TaskHandle> {
        self.client.runs().watch(run_id, listener).await
    }
}

/// The organisation a bearer token names (its `org` claim), read without verifying it: the server verifies the
/// token; the phone only needs the name to pick the account's cache.
pub fn token_org(token: &str) -> Option<String> {
    use base64::Engine;
    let claims = token.split('.').nth(1)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(claims.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&json).ok()?;
    claims["org"].as_str().map(str::to_string)
}

/// The directory and key name of one account. The core binds a cache to one server and organisation, so each
/// pair gets its own; the server part is hashed because a URL is no file name.
fn account_name(server_url: &str, org: &str) -> String {
    // The core trims a trailing slash too: `http://h/` and `http://h` are one account.
    let url = server_url.trim_end_matches('/');
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, url.as_bytes());
    format!("{org}-{}", hex(&digest.as_ref()[..8]))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Creates `dir` if needed and refuses one that others could have written to: a key planted in a shared directory
/// (say under /tmp) would otherwise be loaded and registered as this person's device. A directory owned by someone
/// else with these modes cannot be read by us at all, so the mode check is enough.
fn owner_only_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    create_private_dir(dir)?;
    let meta =
        std::fs::symlink_metadata(dir).with_context(|| format!("reading {}", dir.display()))?;
    if !meta.is_dir() {
        bail!(
            "{} is not a directory (a symlink is refused)",
            dir.display()
        );
    }
    if meta.permissions().mode() & 0o077 != 0 {
        bail!(
            "{} is open to other users (mode {:o}); it holds the device key: make it 0700 (chmod 700)",
            dir.display(),
            meta.permissions().mode() & 0o777
        );
    }
    Ok(())
}

/// A keyring-core credential store keeping each secret in its own file, readable by its owner only. A terminal has
/// no Secure Enclave, and the desktop keyrings' stores are not among this workspace's dependencies; the core takes
/// any keyring-core store, so one of those can replace this without touching the signer.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    pub fn open(dir: &Path) -> anyhow::Result<Arc<CredentialStore>> {
        owner_only_dir(dir)?;
        Ok(Arc::new(FileStore {
            dir: dir.to_path_buf(),
        }))
    }
}

impl CredentialStoreApi for FileStore {
    fn vendor(&self) -> String {
        "loams file store".into()
    }

    fn id(&self) -> String {
        self.dir.display().to_string()
    }

    fn build(
        &self,
        service: &str,
        user: &str,
        modifiers: Option<&std::collections::HashMap<&str, &str>>,
    ) -> keyring_core::Result<Entry> {
        if modifiers.is_some_and(|m| !m.is_empty()) {
            return Err(keyring_core::Error::NotSupportedByStore(
                "the file store takes no entry modifiers".into(),
            ));
        }
        // Hex keeps any service and user name a plain, unambiguous file name.
        let file = format!("{}.{}", hex(service.as_bytes()), hex(user.as_bytes()));
        Ok(Entry::new_with_credential(Arc::new(FileCredential {
            path: self.dir.join(file),
            service: service.to_string(),
            user: user.to_string(),
        })))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[derive(Debug)]
struct FileCredential {
    path: PathBuf,
    service: String,
    user: String,
}

fn storage(e: std::io::Error) -> keyring_core::Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        keyring_core::Error::NoEntry
    } else {
        keyring_core::Error::NoStorageAccess(Box::new(e))
    }
}

impl CredentialApi for FileCredential {
    /// Whole or not at all: a key cut short by a crash would fail to load forever after. The temporary file is
    /// created owner-only in the same directory, then renamed over the target.
    fn set_secret(&self, secret: &[u8]) -> keyring_core::Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let write = || -> std::io::Result<()> {
            let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
            tmp.write_all(secret)?;
            tmp.as_file().sync_all()?;
            tmp.persist(&self.path).map_err(|e| e.error)?;
            Ok(())
        };
        write().map_err(|e| keyring_core::Error::PlatformFailure(Box::new(e)))
    }

    fn get_secret(&self) -> keyring_core::Result<Vec<u8>> {
        std::fs::read(&self.path).map_err(storage)
    }

    fn delete_credential(&self) -> keyring_core::Result<()> {
        std::fs::remove_file(&self.path).map_err(storage)
    }

    /// The entry is the file itself, so it is its own credential (keyring-core's "`None` gives `self` back").
    fn get_credential(&self) -> keyring_core::Result<Option<Arc<Credential>>> {
        std::fs::metadata(&self.path).map_err(storage)?;
        Ok(None)
    }

    fn get_specifiers(&self) -> Option<(String, String)> {
        Some((self.service.clone(), self.user.clone()))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use loams_core::DeviceSigner;
    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn the_device_key_survives_in_the_file_store_and_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::open(&dir.path().join("keys")).unwrap();
        let first = SoftwareSigner::load_or_create(&store, KEY_SERVICE, "acme-1").unwrap();
        // A second process (a later `loams phone` command) opens the same store.
        let again = FileStore::open(&dir.path().join("keys")).unwrap();
        let second = SoftwareSigner::load_or_create(&again, KEY_SERVICE, "acme-1").unwrap();
        assert_eq!(
            first.public_key().await.unwrap(),
            second.public_key().await.unwrap()
        );
        let other = SoftwareSigner::load_or_create(&again, KEY_SERVICE, "acme-2").unwrap();
        assert_ne!(
            first.public_key().await.unwrap(),
            other.public_key().await.unwrap()
        );

        let files: Vec<_> = std::fs::read_dir(dir.path().join("keys"))
            .unwrap()
            .map(|f| f.unwrap())
            .collect();
        assert_eq!(files.len(), 2, "one file per key, no temporary left");
        for file in &files {
            let mode = file.metadata().unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "{:?} is readable by others", file.path());
        }
        let keys = std::fs::metadata(dir.path().join("keys")).unwrap();
        assert_eq!(keys.permissions().mode() & 0o077, 0);

        SoftwareSigner::delete(&again, KEY_SERVICE, "acme-1").unwrap();
        let entry = Entry::new_in_store(&again, KEY_SERVICE, "acme-1").unwrap();
        assert!(matches!(
            entry.get_secret(),
            Err(keyring_core::Error::NoEntry)
        ));
        assert!(matches!(
            entry.delete_credential(),
            Err(keyring_core::Error::NoEntry)
        ));
    }

    #[test]
    fn the_org_comes_from_the_token_claims() {
        use base64::Engine;
        let claims = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"sub":"alice","org":"acme"}"#);
        assert_eq!(
            token_org(&format!("e30.{claims}.sig")).as_deref(),
            Some("acme")
        );
        assert_eq!(token_org("opaque-token"), None);
        assert_eq!(token_org("a.!!!.c"), None);
        let no_org = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"sub":"a"}"#);
        assert_eq!(token_org(&format!("e30.{no_org}.sig")), None);
    }

    #[test]
    fn a_shared_or_linked_key_directory_and_a_path_like_org_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = FileStore::open(&shared).unwrap_err().to_string();
        assert!(err.contains("open to other users (mode 777)"), "{err}");

        let private = dir.path().join("private");
        std::fs::create_dir(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&private, &link).unwrap();
        let err = FileStore::open(&link).unwrap_err().to_string();
        assert!(err.contains("symlink"), "{err}");
        FileStore::open(&private).unwrap();

        // A data directory two levels down, so that `../../x` would land in `dir`, which we can watch.
        let data_dir = dir.path().join("a/b");
        let before: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        let err = Phone::open("http://127.0.0.1:1", "../../x", "t".into(), &data_dir)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("setting `org`"), "{err}");
        let after: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(before, after, "nothing was created");
        assert!(!data_dir.exists());
    }

    #[test]
    fn each_server_and_org_has_its_own_account() {
        let a = account_name("http://127.0.0.1:8080/", "acme");
        assert_eq!(a, account_name("http://127.0.0.1:8080", "acme"));
        assert_ne!(a, account_name("http://127.0.0.1:8081", "acme"));
        assert_ne!(a, account_name("http://127.0.0.1:8080", "other"));
        assert!(a.starts_with("acme-"));
    }
}
