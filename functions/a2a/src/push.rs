//! Push notifications (A2A §4.3, §13.2): the four config RPCs, with configs kept in the platform
//! `Store` beside the task, and delivery of task updates to the registered webhooks.
//!
//! A webhook gets each update as the StreamResponse JSON a subscriber would see, with
//! `Authorization: <scheme> <credentials>` from the config's authentication and its token in both
//! `X-A2A-Notification-Token` (a2a-python) and `A2A-Notification-Token` (a2a-rs). Targets that are
//! private, loopback, link-local (or otherwise not public, an IPv6 address standing for such an IPv4
//! one included) are refused, when registered and again when connecting (the DNS answer is checked,
//! so a public name cannot lead inside), and so are single-label and internal host names, unless
//! [`PushOptions::allow_private_targets`] is set. Not covered: the agent host's own global addresses
//! (traffic to them never leaves the host: a deployment with any needs a host-level output rule or a
//! network namespace of its own for the agents) and an operator's internal global prefixes (an
//! egress filter). The Lambda functions have neither.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use a2a::{
    A2AError, DeleteTaskPushNotificationConfigRequest, GetTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest, ListTaskPushNotificationConfigsResponse,
    StreamResponse, TaskPushNotificationConfig,
};
use loams_platform::{Cond, Item, Page, StoreError};

use crate::auth::Principal;
use crate::server::A2A_JSON;
use crate::tasks::{Agent, StoredTask, check_id, store_failure};

/// Item kind of stored push-notification configs.
pub const PUSH_KIND: &str = "a2a_push";
/// Most webhooks one task may have.
const MAX_CONFIGS_PER_TASK: usize = 10;
const MAX_URL: usize = 2048;
const MAX_TOKEN: usize = 1024;
const MAX_CREDENTIALS: usize = 4096;
const MAX_CONFIG_ID: usize = 64;

/// How the agent delivers push notifications.
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// Allow webhooks on private, loopback and link-local addresses, and at single-label and internal
    /// host names (local tests, a trusted network); the system resolver then answers as it is set up,
    /// `/etc/hosts` included. Off by default: a caller could otherwise make the agent probe its own
    /// network.
    pub allow_private_targets: bool,
    /// Delivery attempts per update and webhook.
    pub attempts: u32,
    /// Wait before the second attempt; doubled for each further one.
    pub backoff: Duration,
    /// Timeout of one delivery attempt.
    pub timeout: Duration,
}

impl Default for PushOptions {
    fn default() -> Self {
        PushOptions {
            allow_private_targets: false,
            attempts: 5,
            backoff: Duration::from_millis(500),
            timeout: Duration::from_secs(10),
        }
    }
}

/// Whether `ip` is an ordinary public unicast address.
fn public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => public_v4(v4),
        IpAddr::V6(v6) => match embedded_v4(v6) {
            Some(v4) => public_v4(v4),
            None => public_v6(v6),
        },
    }
}

/// The IPv4 address an IPv6 address stands for, where a host or a translator on the way would reach that IPv4
/// address instead: IPv4-mapped (`::ffff:0:0/96`), IPv4-compatible (`::/96`: `::` and `::1` become 0.0.0.0 and
/// 0.0.0.1, refused as 0.0.0.0/8), IPv4-translated (`::ffff:0:0:0/96`, SIIT), NAT64 (`64:ff9b::/96`, RFC 6052) and
/// 6to4 (`2002::/16`, RFC 3056). Without this, a webhook at `[64:ff9b::a00:1]` would reach 10.0.0.1 from an agent
/// in a network with a NAT64 gateway. A NAT64 prefix a network chose itself cannot be recognised here.
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let v4 = |hi: u16, lo: u16| Ipv4Addr::from(u32::from(hi) << 16 | u32::from(lo));
    match ip.segments() {
        [0, 0, 0, 0, 0, 0 | 0xffff, hi, lo]
        | [0, 0, 0, 0, 0xffff, 0, hi, lo]
        | [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] => Some(v4(hi, lo)),
        [0x2002, hi, lo, ..] => Some(v4(hi, lo)),
        _ => None,
    }
}

fn public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_private()
        || ip.is_loopback()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        // Shared address space (carrier-grade NAT), RFC 6598.
        || (a == 100 && (64..128).contains(&b))
        // Reserved for future use and benchmarking.
        || a >= 240
        || (a == 198 && (b == 18 || b == 19))
        // IETF protocol assignments 192.0.0.0/24 (DS-Lite, NAT64 discovery) and the former 6to4 relay anycast.
        || (a == 192 && b == 0 && c == 0)
        || (a == 192 && b == 88 && c == 99))
}

fn public_v6(ip: Ipv6Addr) -> bool {
    let [first, second, ..] = ip.segments();
    // Only global unicast 2000::/3: loopback, unspecified, multicast, unique local, link-local, site-local and
    // local-use NAT64 lie outside it (the addresses standing for IPv4 ones were judged by those before).
    // Within it, not public: the IETF protocol assignments 2001::/23 (Teredo, whose client address is obfuscated,
    // benchmarking, anycast for nearby services, ORCHID) and documentation, 2001:db8::/32 and 3fff::/20.
    let special = match first {
        0x2001 => second < 0x0200 || second == 0x0db8,
        0x3fff => (second & 0xf000) == 0,
        _ => false,
    };
    (first & 0xe000) == 0x2000 && !special
}

/// A resolver that answers only public addresses: the check happens on the addresses actually
/// connected to, so DNS cannot point a public-looking name at the agent's own network.
struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let name = absolute(&host);
            let resolved = tokio::net::lookup_host((name.as_str(), 0)).await?;
            let addrs = public_addrs(&host, resolved)?;
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// `host` as an absolute name. The resolver's search list would otherwise complete a name that does not resolve
/// as typed (`jenkins.build` to `jenkins.build.corp.example.com`) into the agent's network. The price: on glibc,
/// an absolute name skips `/etc/hosts`, so a webhook host pinned only there (a container's `extra_hosts`) does not
/// resolve unless private targets are allowed.
fn absolute(host: &str) -> String {
    if host.ends_with('.') {
        host.to_string()
    } else {
        format!("{host}.")
    }
}

/// The public ones among the addresses `host` resolved to, or why there are none.
fn public_addrs(
    host: &str,
    resolved: impl IntoIterator<Item = SocketAddr>,
) -> Result<Vec<SocketAddr>, String> {
    let addrs: Vec<SocketAddr> = resolved.into_iter().filter(|a| public(a.ip())).collect();
    if addrs.is_empty() {
        return Err(format!("{host} has no public address"));
    }
    Ok(addrs)
}

/// The agent's webhook client, built on first use. A build fails only without a usable TLS backend (no root
/// certificates could be read, say); that delivery then fails and the next one tries again, since no other client
/// would keep the target checks.
fn sender(agent: &Agent) -> Result<&reqwest::Client, reqwest::Error> {
    if let Some(client) = agent.push_client.get() {
        return Ok(client);
    }
    let built = build_sender(&agent.options.push)?;
    // Two first deliveries at once may both build one; the first kept serves both.
    Ok(agent.push_client.get_or_init(|| built))
}

/// The HTTP client webhooks are called with.
fn build_sender(options: &PushOptions) -> Result<reqwest::Client, reqwest::Error> {
    let builder = reqwest::Client::builder()
        .timeout(options.timeout)
        // A redirect would lead past the target check; a proxy would resolve names itself.
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy();
    if options.allow_private_targets {
        builder.build()
    } else {
        builder.dns_resolver(Arc::new(PublicOnly)).build()
    }
}

/// Checks a webhook URL: http(s), a host, and (unless allowed) no literal non-public address and no single-label
/// or internal host name.
fn check_url(url: &str, options: &PushOptions) -> Result<(), A2AError> {
    let bad = |why: &str| A2AError::invalid_params(format!("push notification url: {why}"));
    if url.len() > MAX_URL {
        return Err(bad("too long"));
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(bad("must be http or https"));
    }
    // IP literals arrive parsed (decimal, octal and hex IPv4 forms normalised); names are checked again on the
    // addresses they resolve to.
    let host = parsed.host().ok_or_else(|| bad("needs a host"))?;
    if options.allow_private_targets {
        return Ok(());
    }
    let private = match host {
        url::Host::Ipv4(ip) => !public(IpAddr::V4(ip)),
        url::Host::Ipv6(ip) => !public(IpAddr::V6(ip)),
        url::Host::Domain(name) => internal_name(name),
    };
    if private {
        return Err(bad(
            "private, loopback and link-local addresses, and single-label or internal host names (the agent's own \
             network), are not allowed",
        ));
    }
    Ok(())
}

/// Whether `host` can only name a host of a private network: a single label (answered by the local network's
/// name services, mDNS, LLMNR, or completed from a search list), or a name in a domain kept for private networks
/// or testing (`internal`, `local`, `home.arpa`, `localhost`, `test`, and the customary `localdomain`, `lan`,
/// `corp`, `home`, `intranet`, `private`, none of them delegated). Such names may resolve to global addresses that
/// the network's firewalls trust.
fn internal_name(host: &str) -> bool {
    const PRIVATE_DOMAINS: [&str; 11] = [
        "internal",
        "local",
        "home.arpa",
        "localhost",
        "test",
        "localdomain",
        "lan",
        "corp",
        "home",
        "intranet",
        "private",
    ];
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let labels: Vec<&str> = host.split('.').collect();
    // An empty label (`.jenkins`) would hide a single one.
    labels.len() < 2
        || labels.contains(&"")
        || PRIVATE_DOMAINS.iter().any(|domain| {
            host == *domain
                || host
                    .strip_suffix(domain)
                    .is_some_and(|rest| rest.ends_with('.'))
        })
}

pub(crate) fn check_config(
    config: &TaskPushNotificationConfig,
    options: &PushOptions,
) -> Result<(), A2AError> {
    check_url(&config.url, options)?;
    if config
        .token
        .as_ref()
        .is_some_and(|t| t.len() > MAX_TOKEN || t.chars().any(char::is_control))
    {
        return Err(A2AError::invalid_params(format!(
            "token must be at most {MAX_TOKEN} bytes without control characters"
        )));
    }
    if let Some(auth) = &config.authentication {
        let printable = |s: &str| !s.chars().any(char::is_control);
        if auth.scheme.is_empty()
            || auth.scheme.len() > 64
            || !auth
                .scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            || auth
                .credentials
                .as_ref()
                .is_some_and(|c| c.len() > MAX_CREDENTIALS || !printable(c))
        {
            return Err(A2AError::invalid_params(
                "authentication needs a token-like scheme and printable credentials",
            ));
        }
    }
    if let Some(id) = &config.id
        && (id.is_empty()
            || id.len() > MAX_CONFIG_ID
            || !id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)))
    {
        return Err(A2AError::invalid_params(format!(
            "config id must be 1..={MAX_CONFIG_ID} of [A-Za-z0-9-_.]"
        )));
    }
    Ok(())
}

fn random_id() -> Result<String, A2AError> {
    let mut bytes = [0u8; 12];
    aws_lc_rs::rand::fill(&mut bytes).map_err(|_| A2AError::internal("no randomness"))?;
    Ok(hex::encode(bytes))
}

impl Agent {
    /// The start of the store ids of the push configs of `subject`'s task `task_id`: its caller's task prefix
    /// and the task id hashed, a fixed length, so that no task's prefix starts another's (a task id may hold
    /// any character: task `x`'s prefix would otherwise start task `x:y`'s).
    fn push_prefix(&self, subject: &str, task_id: &str) -> String {
        let task = &crate::tasks::sha256_hex(task_id.as_bytes())[..32];
        format!(
            "{}{task}:",
            crate::tasks::caller_prefix(&self.name, subject)
        )
    }

    fn push_item_id(&self, subject: &str, task_id: &str, config_id: &str) -> String {
        format!("{}{config_id}", self.push_prefix(subject, task_id))
    }

    async fn configs(
        &self,
        subject: &str,
        task_id: &str,
    ) -> Result<Vec<TaskPushNotificationConfig>, A2AError> {
        let page = self
            .store
            .list_items_with_prefix(
                &self.org,
                PUSH_KIND,
                &self.push_prefix(subject, task_id),
                Page::first(u32::try_from(MAX_CONFIGS_PER_TASK + 1).unwrap_or(u32::MAX)),
            )
            .await
            .map_err(store_failure)?;
        page.items
            .iter()
            .map(|item| {
                serde_json::from_slice(&item.body)
                    .map_err(|_| A2AError::internal("stored push config is unreadable"))
            })
            .collect()
    }
}

/// Stores `config` for the stored `task`, replacing a config of the same id. Also used for the config
/// carried by SendMessage. The config goes when its task does: a reader's task expires (and with it the
/// only way to reach the config), so its webhook and credentials are not kept past it.
pub(crate) async fn create_config(
    agent: &Agent,
    task: &StoredTask,
    mut config: TaskPushNotificationConfig,
) -> Result<TaskPushNotificationConfig, A2AError> {
    let (subject, task_id) = (task.caller.as_str(), task.task.id.as_str());
    check_config(&config, &agent.options.push)?;
    let id = match config.id.take() {
        Some(id) => id,
        None => random_id()?,
    };
    let existing = agent.configs(subject, task_id).await?;
    if existing.len() >= MAX_CONFIGS_PER_TASK
        && !existing.iter().any(|c| c.id.as_deref() == Some(&id))
    {
        return Err(A2AError::invalid_params(format!(
            "a task has at most {MAX_CONFIGS_PER_TASK} push notification configs"
        )));
    }
    config.id = Some(id.clone());
    config.task_id = task_id.to_string();
    config.tenant = None;
    let body = serde_json::to_vec(&config).map_err(|e| A2AError::internal(e.to_string()))?;
    let item = Item {
        org: agent.org.clone(),
        kind: PUSH_KIND.into(),
        id: agent.push_item_id(subject, task_id, &id),
        version: 0,
        index: None,
        body,
        expires_ms: task.expires_ms,
    };
    agent
        .store
        .put_item(&item, Cond::Any)
        .await
        .map_err(store_failure)?;
    Ok(config)
}

/// CreateTaskPushNotificationConfig on the caller's task.
pub(crate) async fn create(
    agent: &Agent,
    caller: &Principal,
    config: TaskPushNotificationConfig,
) -> Result<TaskPushNotificationConfig, A2AError> {
    let (task, _) = agent.own_record(&caller.subject, &config.task_id).await?;
    create_config(agent, &task, config).await
}

pub(crate) async fn get(
    agent: &Agent,
    caller: &Principal,
    req: &GetTaskPushNotificationConfigRequest,
) -> Result<TaskPushNotificationConfig, A2AError> {
    agent.own(&caller.subject, &req.task_id).await?;
    check_id("config id", &req.id)?;
    let item = agent
        .store
        .get_item(
            &agent.org,
            PUSH_KIND,
            &agent.push_item_id(&caller.subject, &req.task_id, &req.id),
        )
        .await
        .map_err(store_failure)?
        .ok_or_else(|| A2AError::task_not_found(&req.task_id))?;
    serde_json::from_slice(&item.body)
        .map_err(|_| A2AError::internal("stored push config is unreadable"))
}

pub(crate) async fn list(
    agent: &Agent,
    caller: &Principal,
    req: &ListTaskPushNotificationConfigsRequest,
) -> Result<ListTaskPushNotificationConfigsResponse, A2AError> {
    agent.own(&caller.subject, &req.task_id).await?;
    // At most MAX_CONFIGS_PER_TASK exist, so one page always holds them all.
    Ok(ListTaskPushNotificationConfigsResponse {
        configs: agent.configs(&caller.subject, &req.task_id).await?,
        next_page_token: None,
    })
}

pub(crate) async fn delete(
    agent: &Agent,
    caller: &Principal,
    req: &DeleteTaskPushNotificationConfigRequest,
) -> Result<(), A2AError> {
    agent.own(&caller.subject, &req.task_id).await?;
    check_id("config id", &req.id)?;
    match agent
        .store
        .delete_item(
            &agent.org,
            PUSH_KIND,
            &agent.push_item_id(&caller.subject, &req.task_id, &req.id),
        )
        .await
    {
        Ok(()) | Err(StoreError::NotFound) => Ok(()),
        Err(e) => Err(store_failure(e)),
    }
}

/// Delivers `events` of `subject`'s task `task_id` to the webhooks registered now, in order per webhook,
/// in the background. A failure is logged: the update itself is stored and readable with GetTask either
/// way.
pub(crate) async fn notify(
    agent: &Arc<Agent>,
    subject: &str,
    task_id: &str,
    events: Vec<StreamResponse>,
) {
    if events.is_empty() {
        return;
    }
    let configs = match agent.configs(subject, task_id).await {
        Ok(configs) => configs,
        Err(e) => {
            tracing::warn!(task = %task_id, error = %e, "reading push configs");
            return;
        }
    };
    if configs.is_empty() {
        return;
    }
    let agent = agent.clone();
    tokio::spawn(async move {
        let deliveries = configs.iter().map(|config| async {
            for event in &events {
                deliver(&agent, config, event).await;
            }
        });
        futures::future::join_all(deliveries).await;
    });
}

/// A webhook's origin, which is all the logs name of it: webhook URLs often carry a secret in their path, query
/// or user info.
fn origin(url: &str) -> String {
    reqwest::Url::parse(url)
        .map(|u| u.origin().ascii_serialization())
        .unwrap_or_else(|_| "(not a url)".into())
}

/// One update to one webhook, retried with exponential backoff on transport errors, 5xx and 429.
async fn deliver(agent: &Agent, config: &TaskPushNotificationConfig, event: &StreamResponse) {
    let options = &agent.options.push;
    if let Err(e) = check_url(&config.url, options) {
        tracing::warn!(webhook = %origin(&config.url), error = %e, "push target refused");
        return;
    }
    let body = match serde_json::to_vec(event) {
        Ok(body) => body,
        Err(e) => {
            tracing::error!(error = %e, "encoding a push notification");
            return;
        }
    };
    let client = match sender(agent) {
        Ok(client) => client,
        Err(e) => {
            tracing::error!(error = %e, "push notification client");
            return;
        }
    };
    let attempts = options.attempts.max(1);
    let mut wait = options.backoff;
    for attempt in 1..=attempts {
        let mut req = client
            .post(&config.url)
            .header(reqwest::header::CONTENT_TYPE, A2A_JSON)
            .body(body.clone());
        if let Some(auth) = &config.authentication {
            let value = match &auth.credentials {
                Some(c) => format!("{} {c}", auth.scheme),
                None => auth.scheme.clone(),
            };
            req = req.header(reqwest::header::AUTHORIZATION, value);
        }
        if let Some(token) = &config.token {
            req = req
                .header("X-A2A-Notification-Token", token)
                .header("A2A-Notification-Token", token);
        }
        let retry = match req.send().await {
            Ok(resp) if resp.status().is_success() => return,
            Ok(resp) => {
                let status = resp.status();
                tracing::warn!(webhook = %origin(&config.url), %status, attempt, "push notification refused");
                status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS
            }
            Err(e) => {
                let e = e.without_url();
                tracing::warn!(webhook = %origin(&config.url), error = %e, attempt, "push notification failed");
                true
            }
        };
        if !retry || attempt == attempts {
            return;
        }
        tokio::time::sleep(wait).await;
        wait = wait.saturating_mul(2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_are_targets() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            // Translated or tunnelled to a private IPv4 address: IPv4-compatible, NAT64, 6to4.
            "::",
            "::127.0.0.1",
            "::10.0.0.1",
            "64:ff9b::10.0.0.1",
            "64:ff9b::169.254.169.254",
            "2002:a00:1::1",
            "2002:7f00:1::",
            "::ffff:0:10.0.0.1",
            // Local-use NAT64 and Teredo.
            "64:ff9b:1::8.8.8.8",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            // Outside global unicast, or special within it.
            "fec0::1",
            "5f00::1",
            "100::1",
            "3fff::1",
            "3fff:fff::1",
            "2001:db8::1",
            "2001:2::1",
            "2001:1::1",
            "2001:1ff:ffff::1",
            "192.0.0.170",
            "192.88.99.1",
        ] {
            assert!(!public(private.parse().unwrap()), "{private}");
        }
        for ok in [
            "8.8.8.8",
            "1.1.1.1",
            "2606:4700:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::8.8.8.8",
            "2002:808:808::1",
            "::ffff:0:8.8.8.8",
            // Just outside 3fff::/20 and 2001::/23.
            "3fff:1000::1",
            "2001:200::1",
        ] {
            assert!(public(ok.parse().unwrap()), "{ok}");
        }
    }

    #[test]
    fn logs_name_a_webhook_by_its_origin_only() {
        assert_eq!(
            origin("https://user:pw@hooks.example.com:8443/T0/B1/secret?token=x"),
            "https://hooks.example.com:8443"
        );
        assert_eq!(origin("not a url"), "(not a url)");
    }

    #[test]
    fn names_are_looked_up_absolute_and_only_public_answers_kept() {
        assert_eq!(absolute("hooks.example.com"), "hooks.example.com.");
        assert_eq!(absolute("hooks.example.com."), "hooks.example.com.");
        let at = |ip: &str| SocketAddr::new(ip.parse().unwrap(), 0);
        assert_eq!(
            public_addrs("h", [at("127.0.0.1"), at("8.8.8.8"), at("fd00::1")]),
            Ok(vec![at("8.8.8.8")])
        );
        let inside = public_addrs("h", [at("10.0.0.1"), at("64:ff9b::a00:1")]);
        assert_eq!(inside, Err("h has no public address".to_string()));
    }

    #[test]
    fn urls_are_checked() {
        let strict = PushOptions::default();
        let open = PushOptions {
            allow_private_targets: true,
            ..PushOptions::default()
        };
        for bad in [
            "http://127.0.0.1:9/h",
            "http://localhost/h",
            "http://[::1]/h",
            "http://169.254.169.254/latest",
            "http://10.0.0.1/",
            "http://[64:ff9b::a9fe:a9fe]/latest",
            "http://2130706433/",
            "http://0x7f.1/",
            "http://jenkins:8080/job",
            "http://.jenkins/",
            "http://ci..corp.example/",
            "http://db.corp.internal/",
            "http://printer.local./",
            "http://router.home.arpa/",
            "http://home.arpa/",
            "http://app.localhost/",
            "http://ci.lan/",
            "http://ci.test/",
            "http://nas.home/",
            "http://wiki.corp/",
            "http://portal.intranet/",
            "http://git.private/",
        ] {
            assert!(check_url(bad, &strict).is_err(), "{bad}");
            assert!(check_url(bad, &open).is_ok(), "{bad}");
        }
        for bad in ["ftp://example.com/", "not a url", "data:text/plain,x"] {
            assert!(check_url(bad, &open).is_err(), "{bad}");
        }
        for ok in [
            "https://hooks.example.com/a2a",
            "https://hooks.example.com./a2a",
            "https://bücher.example/hook",
            "https://api.localhost.run/hook",
            "https://hooks.international/a2a",
            // Ending in a listed domain's letters, not in the domain.
            "https://hooks.contest/a2a",
            "https://ci.atlan/",
        ] {
            assert!(check_url(ok, &strict).is_ok(), "{ok}");
        }
    }
}
