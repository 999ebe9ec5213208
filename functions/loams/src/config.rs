//! `loams dev` configuration: one typed struct read once at start from a TOML file and flags.
//!
//! Every setting has a default that runs the whole stack on 127.0.0.1 with the sandbox apps and the replay model,
//! so `loams dev` with no arguments works; a bad value fails at start with a message naming the setting.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Largest configuration file accepted; a real one is a few hundred bytes.
const MAX_CONFIG_BYTES: u64 = 256 * 1024;
/// Shortest webhook token accepted: the URL is the only secret of an unsigned webhook.
pub const MIN_WEBHOOK_TOKEN: usize = 24;
/// Whether `url` is one the HTTP clients can call: every URL setting is checked with this at start.
pub(crate) fn is_http_url(url: &str) -> bool {
    url.starts_with("https://") || url.starts_with("http://")
}

/// The five agents, by the names policy rules, agent URLs and functions use.
pub const AGENTS: [&str; 5] = ["zulip", "plane", "forgejo", "glitchtip", "analytics"];

/// A credential read from the config: kept out of `Debug` output so a logged config never shows it.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is larger than {MAX_CONFIG_BYTES} bytes")]
    TooLarge { path: PathBuf },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("setting `{setting}`: {message}")]
    Invalid {
        setting: &'static str,
        message: String,
    },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address of the HTTP API (Connect services, webhooks, JWKS).
    pub listen: SocketAddr,
    /// Directory of the embedded store (created if absent).
    pub data_dir: PathBuf,
    /// The organisation this single-process deployment serves.
    pub org: String,
    /// Environment name runs are opened in (policy decides per environment).
    pub env: String,
    /// The person runs act for (the on-call engineer the alerts page): approvals are requested on their behalf,
    /// so they cannot approve them themselves.
    pub owner: String,
    /// Shared secret in the GlitchTip alert webhook URL (`/webhooks/glitchtip/<token>`). Unset: a random one is
    /// made on first start and kept in the data directory (`webhook.token`).
    pub webhook_token: Option<Secret>,
    pub model: ModelSettings,
    pub factory: FactorySettings,
    /// Which agent calls are allowed, need an approval or are denied (DESIGN.md section 5 defaults).
    pub policy: loams_factory::Policy,
    /// App endpoints and credentials. Absent: the sandbox apps are started in-process.
    pub apps: Option<AppSettings>,
    /// Where runs, the queue and timers live: the embedded SQLite store, or DynamoDB and SQS.
    pub backend: BackendSettings,
    /// Signed webhooks the apps send (`/webhooks/<app>/<id>`), recorded as `app_event` items.
    pub webhooks: WebhookSettings,
}

/// The apps' signed webhooks, per app. Forgejo and Plane sign each delivery with the hook's secret; Zulip's
/// outgoing webhook carries it (the bot's token) in the body.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhookSettings {
    pub forgejo: Vec<HookSettings>,
    pub plane: Vec<HookSettings>,
    pub zulip: Vec<HookSettings>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookSettings {
    /// The last segment of the hook's URL; not a secret.
    pub id: String,
    /// At least 16 bytes.
    pub secret: Secret,
}

impl WebhookSettings {
    fn validate(&self) -> Result<(), ConfigError> {
        for (setting, hooks) in [
            ("webhooks.forgejo", &self.forgejo),
            ("webhooks.plane", &self.plane),
            ("webhooks.zulip", &self.zulip),
        ] {
            for hook in hooks {
                let id_ok = !hook.id.is_empty()
                    && hook.id.len() <= 64
                    && hook
                        .id
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
                if !id_ok {
                    return Err(ConfigError::Invalid {
                        setting,
                        message: "a hook id is 1..=64 of [A-Za-z0-9_-]".into(),
                    });
                }
                // The API refuses deliveries to a hook with a shorter secret; say so at start instead.
                let min = loams_api::webhooks::MIN_SECRET;
                if hook.secret.expose().len() < min {
                    return Err(ConfigError::Invalid {
                        setting,
                        message: format!(
                            "hook `{}`: the secret is shorter than {min} bytes",
                            hook.id
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// The hooks of one app as the API takes them, all in `org`.
    pub fn for_api(hooks: &[HookSettings], org: &str) -> Vec<loams_api::AppHook> {
        hooks
            .iter()
            .map(|h| loams_api::AppHook {
                id: h.id.clone(),
                org: org.to_string(),
                secret: h.secret.expose().to_string(),
            })
            .collect()
    }
}

/// Which adapter serves the `Store` and `Timers` ports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    #[default]
    Sqlite,
    Dynamodb,
}

/// Which adapter serves the `Queue` port.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueKind {
    #[default]
    Sqlite,
    Sqs,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct BackendSettings {
    pub store: StoreKind,
    pub queue: QueueKind,
    /// A local AWS emulator (moto) at this URL: dummy credentials, and the table and queue are created when
    /// absent. Unset: AWS itself, with the region and credentials of the environment, and the table and queue
    /// must exist (the SAM template makes them).
    pub aws_endpoint: Option<String>,
    /// The DynamoDB table (`store = "dynamodb"`).
    pub table: String,
    /// The SQS queue's name (`queue = "sqs"`); its dead-letter queue is `<name>-dlq`. Used with `aws_endpoint`.
    pub queue_name: String,
    /// The queue's URL on AWS (`queue = "sqs"` without `aws_endpoint`), with its dead-letter queue's.
    pub queue_url: Option<String>,
    pub dead_letter_url: Option<String>,
}

impl Default for BackendSettings {
    fn default() -> Self {
        BackendSettings {
            store: StoreKind::Sqlite,
            queue: QueueKind::Sqlite,
            aws_endpoint: None,
            table: "loams".into(),
            queue_name: "loams-work".into(),
            queue_url: None,
            dead_letter_url: None,
        }
    }
}

impl BackendSettings {
    /// Whether any port is served by AWS.
    pub fn uses_aws(&self) -> bool {
        self.store == StoreKind::Dynamodb || self.queue == QueueKind::Sqs
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_settings()?;
        if self.uses_aws() && !cfg!(feature = "aws") {
            let setting = if self.store == StoreKind::Dynamodb {
                "backend.store"
            } else {
                "backend.queue"
            };
            return Err(ConfigError::Invalid {
                setting,
                message: "this build has no AWS adapters (build loams with `--features aws`)"
                    .into(),
            });
        }
        Ok(())
    }

    fn validate_settings(&self) -> Result<(), ConfigError> {
        let invalid = |setting, message: String| Err(ConfigError::Invalid { setting, message });
        if let Some(url) = &self.aws_endpoint
            && !is_http_url(url)
        {
            return invalid(
                "backend.aws_endpoint",
                format!("must be an http(s) URL, not {url:?}"),
            );
        }
        // DynamoDB's table name rule.
        let table_ok = (3..=255).contains(&self.table.len())
            && self
                .table
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if self.store == StoreKind::Dynamodb && !table_ok {
            return invalid(
                "backend.table",
                "must be 3-255 characters of a-z, A-Z, 0-9, '_', '.' and '-'".into(),
            );
        }
        if self.queue != QueueKind::Sqs {
            return Ok(());
        }
        match (&self.queue_url, &self.dead_letter_url, &self.aws_endpoint) {
            (Some(_), None, _) => {
                return invalid(
                    "backend.dead_letter_url",
                    "must be set together with backend.queue_url".into(),
                );
            }
            (None, Some(_), _) => {
                return invalid(
                    "backend.queue_url",
                    "must be set together with backend.dead_letter_url".into(),
                );
            }
            (None, None, None) => {
                return invalid(
                    "backend.queue_url",
                    "is required for queue = \"sqs\" on AWS (or set backend.aws_endpoint to use a local emulator)"
                        .into(),
                );
            }
            (Some(queue), Some(dlq), _) => {
                for (setting, url) in [
                    ("backend.queue_url", queue),
                    ("backend.dead_letter_url", dlq),
                ] {
                    if !is_http_url(url) {
                        return invalid(setting, format!("must be an http(s) URL, not {url:?}"));
                    }
                }
            }
            (None, None, Some(_)) => {}
        }
        // SQS's queue name rule, leaving room for the `-dlq` suffix of the dead-letter queue.
        let name_ok = (1..=76).contains(&self.queue_name.len())
            && self
                .queue_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b));
        if !name_ok {
            return invalid(
                "backend.queue_name",
                "must be 1-76 characters of a-z, A-Z, 0-9, '_' and '-'".into(),
            );
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSettings {
    /// A recorded cassette to replay instead of calling a model (the demo and the tests use one).
    pub cassette: Option<PathBuf>,
    pub base_url: String,
    pub model: String,
    /// Name of the environment variable holding the API key (the key itself never sits in a file).
    pub api_key_env: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FactorySettings {
    pub max_attempts: u32,
    pub max_generations: u32,
    pub observe_window_ms: u64,
    pub ci_poll_ms: u64,
    pub budget_micros: u64,
    pub budget_tokens: u64,
    /// The organisation's model spend per calendar month (UTC) over all runs; unset: no monthly limit.
    pub org_budget_micros: Option<u64>,
    pub org_budget_tokens: Option<u64>,
    pub cooldown_ms: u64,
    /// Files of the repository the fix stage shows the model.
    pub target_files: Vec<String>,
    /// Zulip channel for triage threads.
    pub channel: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppSettings {
    pub zulip: ZulipSettings,
    pub plane: PlaneSettings,
    pub forgejo: ForgejoSettings,
    pub glitchtip: GlitchtipSettings,
    pub analytics: AnalyticsSettings,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZulipSettings {
    pub url: String,
    pub email: String,
    pub api_key: Secret,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlaneSettings {
    pub url: String,
    pub api_key: Secret,
    pub workspace: String,
    pub project_id: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForgejoSettings {
    pub url: String,
    pub token: Secret,
    pub owner: String,
    pub repo: String,
    pub base: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GlitchtipSettings {
    pub url: String,
    pub token: Secret,
    pub org: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnalyticsSettings {
    pub url: String,
    pub client_id: String,
    pub client_secret: Secret,
    pub project_id: String,
}

/// One app's settings: all that one agent needs. On Lambda each agent function reads only its own app's, from its
/// own secret (`loams::lambda`), so no function holds another app's credentials.
#[derive(Debug, Clone)]
pub enum App {
    Zulip(ZulipSettings),
    Plane(PlaneSettings),
    Forgejo(ForgejoSettings),
    Glitchtip(GlitchtipSettings),
    Analytics(AnalyticsSettings),
}

impl AppSettings {
    /// The settings of the app agent `name` works on.
    pub fn app(&self, name: &str) -> Option<App> {
        Some(match name {
            "zulip" => App::Zulip(self.zulip.clone()),
            "plane" => App::Plane(self.plane.clone()),
            "forgejo" => App::Forgejo(self.forgejo.clone()),
            "glitchtip" => App::Glitchtip(self.glitchtip.clone()),
            "analytics" => App::Analytics(self.analytics.clone()),
            _ => return None,
        })
    }
}

impl App {
    /// App `name`'s settings from a JSON object with the fields of `[apps.<name>]`, every value a string. The error
    /// names a field at most and never quotes a value: the object holds the app's credentials.
    pub fn from_json(name: &str, text: &str) -> Result<App, String> {
        let object: serde_json::Map<String, serde_json::Value> =
            // Not `{e}`: for a value of the wrong type serde quotes the value, and this text is the secret.
            serde_json::from_str(text).map_err(|e| {
                format!(
                    "not a JSON object ({:?} error at line {}, column {})",
                    e.classify(),
                    e.line(),
                    e.column()
                )
            })?;
        // serde quotes a value of the wrong type in its message; refuse one first, by its key alone.
        if let Some((key, _)) = object.iter().find(|(_, value)| !value.is_string()) {
            let key: String = key.chars().take(64).collect();
            return Err(format!("`{key}` must be a string"));
        }
        let value = serde_json::Value::Object(object);
        let app = match name {
            "zulip" => serde_json::from_value(value).map(App::Zulip),
            "plane" => serde_json::from_value(value).map(App::Plane),
            "forgejo" => serde_json::from_value(value).map(App::Forgejo),
            "glitchtip" => serde_json::from_value(value).map(App::Glitchtip),
            "analytics" => serde_json::from_value(value).map(App::Analytics),
            other => return Err(format!("no app named {other}")),
        }
        .map_err(|e| e.to_string())?;
        if !is_http_url(app.url()) {
            return Err("`url` must be an http(s) URL".into());
        }
        Ok(app)
    }

    pub fn url(&self) -> &str {
        match self {
            App::Zulip(s) => &s.url,
            App::Plane(s) => &s.url,
            App::Forgejo(s) => &s.url,
            App::Glitchtip(s) => &s.url,
            App::Analytics(s) => &s.url,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            data_dir: PathBuf::from(".loams"),
            org: "acme".into(),
            env: "production".into(),
            owner: "oncall".into(),
            webhook_token: None,
            model: ModelSettings::default(),
            factory: FactorySettings::default(),
            policy: loams_factory::Policy::default(),
            apps: None,
            backend: BackendSettings::default(),
            webhooks: WebhookSettings::default(),
        }
    }
}

impl Default for ModelSettings {
    fn default() -> Self {
        ModelSettings {
            cassette: None,
            base_url: "https://api.deepseek.com".into(),
            model: "deepseek-chat".into(),
            api_key_env: "DEEPSEEK_API_KEY".into(),
        }
    }
}

impl Default for FactorySettings {
    fn default() -> Self {
        FactorySettings {
            max_attempts: 3,
            max_generations: 2,
            observe_window_ms: 60_000,
            ci_poll_ms: 2_000,
            budget_micros: 2_000_000,
            budget_tokens: 400_000,
            org_budget_micros: None,
            org_budget_tokens: None,
            cooldown_ms: 600_000,
            target_files: vec!["src/checkout.py".into()],
            channel: "factory".into(),
        }
    }
}

impl Config {
    /// Reads `path` (TOML) over the defaults; `None` means defaults only.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let config = match path {
            None => Config::default(),
            Some(path) => {
                let meta = std::fs::metadata(path).map_err(|source| ConfigError::Read {
                    path: path.into(),
                    source,
                })?;
                if meta.len() > MAX_CONFIG_BYTES {
                    return Err(ConfigError::TooLarge { path: path.into() });
                }
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.into(),
                    source,
                })?;
                Config::parse(&text).map_err(|message| ConfigError::Parse {
                    path: path.into(),
                    message,
                })?
            }
        };
        config.validate()?;
        Ok(config)
    }

    /// Parses a configuration. The error names the line and column but never quotes the text: the file holds
    /// the apps' secrets, and start-up errors end up in logs.
    pub fn parse(text: &str) -> Result<Config, String> {
        toml::from_str(text).map_err(|e| match e.span() {
            Some(span) => {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let line_start = before.rfind('\n').map_or(0, |i| i + 1);
                let column = before.len() - line_start + 1;
                // The key on that line names the setting; what follows the `=` may be a secret.
                let key = text[line_start..]
                    .lines()
                    .next()
                    .and_then(|l| l.split_once('='))
                    .map(|(k, _)| k.trim());
                match key.filter(|k| !k.is_empty() && k.len() <= 64) {
                    Some(key) => format!("line {line}, column {column} (`{key}`): {}", e.message()),
                    None => format!("line {line}, column {column}: {}", e.message()),
                }
            }
            None => e.message().to_string(),
        })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |setting, message: &str| {
            Err(ConfigError::Invalid {
                setting,
                message: message.into(),
            })
        };
        // The stores' own rule: an org they would refuse fails here, at start.
        if loams_platform::limits::org(&self.org).is_err() {
            return invalid(
                "org",
                "must be 1-63 characters of a-z, 0-9 and '-', not starting with '-'",
            );
        }
        if self.env.is_empty() {
            return invalid("env", "must not be empty");
        }
        if self.owner.trim().is_empty() || self.owner.len() > 200 {
            return invalid("owner", "must name a user (1-200 characters)");
        }
        if self
            .webhook_token
            .as_ref()
            .is_some_and(|t| t.expose().len() < MIN_WEBHOOK_TOKEN)
        {
            return invalid(
                "webhook_token",
                "must be at least 24 characters (or unset, to generate one)",
            );
        }
        for (i, rule) in self.policy.rules.iter().enumerate() {
            if let Some(agent) = &rule.agent
                && !AGENTS.contains(&agent.as_str())
            {
                return Err(ConfigError::Invalid {
                    setting: "policy.rules",
                    message: format!(
                        "rule {} names agent `{agent}`; known agents: {}",
                        i + 1,
                        AGENTS.join(", ")
                    ),
                });
            }
        }
        let f = &self.factory;
        if !(1..=10).contains(&f.max_attempts) {
            return invalid("factory.max_attempts", "must be between 1 and 10");
        }
        if !(1..=10).contains(&f.max_generations) {
            return invalid("factory.max_generations", "must be between 1 and 10");
        }
        if f.ci_poll_ms == 0 {
            return invalid("factory.ci_poll_ms", "must be above 0");
        }
        if f.target_files.is_empty() {
            return invalid("factory.target_files", "must name at least one file");
        }
        if f.channel.is_empty() {
            return invalid("factory.channel", "must not be empty");
        }
        if self.model.cassette.is_none() {
            if !is_http_url(&self.model.base_url) {
                return invalid("model.base_url", "must be an http(s) URL");
            }
            if self.model.model.is_empty() {
                return invalid("model.model", "must not be empty");
            }
        }
        if let Some(apps) = &self.apps {
            for (setting, url) in [
                ("apps.zulip.url", &apps.zulip.url),
                ("apps.plane.url", &apps.plane.url),
                ("apps.forgejo.url", &apps.forgejo.url),
                ("apps.glitchtip.url", &apps.glitchtip.url),
                ("apps.analytics.url", &apps.analytics.url),
            ] {
                if !is_http_url(url) {
                    return invalid(setting, "must be an http(s) URL");
                }
            }
        }
        self.webhooks.validate()?;
        self.backend.validate()
    }

    /// The model API key, read from the environment variable the config names.
    pub fn model_api_key(&self) -> Result<String, ConfigError> {
        std::env::var(&self.model.api_key_env).map_err(|_| ConfigError::Invalid {
            setting: "model.api_key_env",
            message: format!(
                "environment variable {} is not set (or set model.cassette to replay)",
                self.model.api_key_env
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn the_organisation_budget_is_off_unless_set() {
        assert_eq!(Config::default().factory.org_budget_micros, None);
        let c =
            Config::parse("[factory]\norg_budget_micros = 50000000\norg_budget_tokens = 9000000\n")
                .unwrap();
        c.validate().unwrap();
        assert_eq!(
            (c.factory.org_budget_micros, c.factory.org_budget_tokens),
            (Some(50_000_000), Some(9_000_000))
        );
    }

    #[test]
    fn unknown_setting_is_named() {
        let err = Config::parse("listen = \"127.0.0.1:1\"\nlisten_port = 3\n").unwrap_err();
        assert!(err.contains("listen_port"), "{err}");
    }

    #[test]
    fn bad_values_name_their_setting() {
        let cases = [
            ("org = \"Acme\"", "org"),
            ("owner = \"\"", "owner"),
            ("webhook_token = \"short-token\"", "webhook_token"),
            (
                "[[policy.rules]]\nagent = \"jira\"\nverdict = \"allow\"",
                "policy.rules",
            ),
            ("[factory]\nmax_attempts = 0", "factory.max_attempts"),
            ("[model]\nbase_url = \"ftp://x\"", "model.base_url"),
            (
                "[backend]\nqueue = \"sqs\"\naws_endpoint = \"localhost:5000\"",
                "backend.aws_endpoint",
            ),
            ("[backend]\nqueue = \"sqs\"", "backend.queue_url"),
            (
                "[backend]\nqueue = \"sqs\"\nqueue_url = \"https://q\"",
                "backend.dead_letter_url",
            ),
            (
                "[backend]\nqueue = \"sqs\"\naws_endpoint = \"http://m\"\nqueue_name = \"a.fifo\"",
                "backend.queue_name",
            ),
            (
                "[backend]\nstore = \"dynamodb\"\naws_endpoint = \"http://m\"\ntable = \"t\"",
                "backend.table",
            ),
        ];
        for (text, setting) in cases {
            let err = Config::parse(text)
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(err.contains(setting), "{text}: {err}");
        }
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        // Top-level keys first: in TOML a key after a table header belongs to that table.
        let text = "webhook_token = \"webhook-secret-6-long-enough-here\"\n\
                    [apps.zulip]\nurl = \"http://z\"\nemail = \"bot@z\"\napi_key = \"zulip-secret-1\"\n\
                    [apps.plane]\nurl = \"http://p\"\napi_key = \"plane-secret-2\"\nworkspace = \"w\"\nproject_id = \"p\"\n\
                    [apps.forgejo]\nurl = \"http://f\"\ntoken = \"forgejo-secret-3\"\nowner = \"o\"\nrepo = \"r\"\nbase = \"main\"\n\
                    [apps.glitchtip]\nurl = \"http://g\"\ntoken = \"glitchtip-secret-4\"\norg = \"o\"\n\
                    [apps.analytics]\nurl = \"http://a\"\nclient_id = \"id\"\nclient_secret = \"openpanel-secret-5\"\nproject_id = \"p\"\n";
        let config = Config::parse(text).unwrap();
        config.validate().unwrap();
        let shown = format!("{config:?}");
        for secret in [
            "zulip-secret-1",
            "plane-secret-2",
            "forgejo-secret-3",
            "glitchtip-secret-4",
            "openpanel-secret-5",
            "webhook-secret-6",
        ] {
            assert!(!shown.contains(secret), "{secret} leaked: {shown}");
        }
        assert_eq!(
            config.apps.unwrap().zulip.api_key.expose(),
            "zulip-secret-1"
        );
    }

    #[test]
    fn one_app_is_read_from_json_without_quoting_its_values() {
        let forgejo = r#"{"url": "https://git.example.com", "token": "forgejo-secret-1", "owner": "acme", "repo": "shop", "base": "main"}"#;
        let App::Forgejo(settings) = App::from_json("forgejo", forgejo).unwrap() else {
            panic!("not the forgejo settings");
        };
        assert_eq!(settings.token.expose(), "forgejo-secret-1");
        assert_eq!(settings.base, "main");
        // Another app's settings are not this app's: a secret handed to the wrong agent is refused.
        let err = App::from_json("zulip", forgejo).unwrap_err();
        assert!(err.contains("unknown field"), "{err}");
        for (text, expected) in [
            (
                r#"{"url": "https://z", "email": "b@z"}"#,
                "missing field `api_key`",
            ),
            (
                r#"{"url": "https://z", "email": "b@z", "api_key": 987654321}"#,
                "`api_key` must be a string",
            ),
            (
                r#"{"url": "z.example.com", "email": "b@z", "api_key": "zulip-secret-2"}"#,
                "`url`",
            ),
            ("api_key = \"zulip-secret-3\"", "not a JSON object"),
            // A whole secret stored as a JSON string or number instead of an object.
            ("\"zulip-secret-4\"", "not a JSON object"),
            ("9876543210", "not a JSON object"),
        ] {
            let err = App::from_json("zulip", text).unwrap_err();
            assert!(err.contains(expected), "{text}: {err}");
            for secret in [
                "987654321",
                "zulip-secret-2",
                "zulip-secret-3",
                "zulip-secret-4",
            ] {
                assert!(!err.contains(secret), "{secret} leaked: {err}");
            }
        }
    }

    #[test]
    fn policy_rules_are_read() {
        let config = Config::parse(
            "[policy]\nauto_triage = true\nprotected_envs = [\"production\"]\n\
             [[policy.rules]]\nagent = \"plane\"\nskill = \"comment\"\nverdict = \"deny\"\n",
        )
        .unwrap();
        config.validate().unwrap();
        let p = &config.policy;
        assert!(p.auto_triage);
        assert_eq!(
            p.decide("plane", "comment", loams_factory::Risk::Write, "staging"),
            loams_factory::Verdict::Deny
        );
        assert_eq!(
            p.decide("zulip", "post", loams_factory::Risk::Write, "production"),
            loams_factory::Verdict::Approve
        );
    }

    #[test]
    fn backend_settings_are_read() {
        let config = Config::parse(
            "[backend]\nstore = \"dynamodb\"\nqueue = \"sqs\"\ntable = \"loams-prod\"\n\
             queue_url = \"https://sqs.eu-west-1.amazonaws.com/1/w\"\ndead_letter_url = \"https://sqs.eu-west-1.amazonaws.com/1/w-dlq\"\n",
        )
        .unwrap();
        let b = &config.backend;
        assert_eq!(
            (b.store, b.queue, b.table.as_str()),
            (StoreKind::Dynamodb, QueueKind::Sqs, "loams-prod")
        );
        let checked = config.validate();
        if cfg!(feature = "aws") {
            checked.unwrap();
        } else {
            assert!(checked.unwrap_err().to_string().contains("backend.store"));
        }
        // An unknown adapter is refused by name.
        let err = Config::parse("[backend]\nstore = \"postgres\"").unwrap_err();
        assert!(err.contains("store") && err.contains("dynamodb"), "{err}");
    }

    #[test]
    fn malformed_toml_is_a_parse_error() {
        assert!(Config::parse("listen = ").is_err());
        // Webhook hooks: a short secret is refused by name, a good one accepted.
        let hooks =
            |secret: &str| format!("[[webhooks.forgejo]]\nid = \"repo\"\nsecret = \"{secret}\"\n");
        let err = Config::parse(&hooks("tiny"))
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("webhooks.forgejo") && !err.contains("tiny"),
            "{err}"
        );
        let config = Config::parse(&hooks("0123456789abcdef")).unwrap();
        config.validate().unwrap();
        assert_eq!(
            WebhookSettings::for_api(&config.webhooks.forgejo, "acme")[0].id,
            "repo"
        );
        // A secret on the line with the mistake is not repeated in the error.
        let err =
            Config::parse("webhook_token = \"s3cret-s3cret-s3cret-s3cret\" oops").unwrap_err();
        assert!(err.starts_with("line 1, column "), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
        assert!(Config::parse("listen = \"not an address\"").is_err());
    }
}
