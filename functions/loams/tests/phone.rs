//! `loams phone` as a person uses it: the `loams` binary, one command at a time, against the demo's stack running in
//! this process (the sandbox apps, the agents, the worker and the API). A device is registered, the run's merge
//! approval is listed with its context, approved with the typed phrase (or denied), and the run is watched to its
//! end. Settings that are missing or wrong are refused with the setting named.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use loams::demo::{self, Scenario, post_alert};
use loams::stack::Stack;
use loams_sandbox::SandboxHandle;

const BIN: &str = env!("CARGO_BIN_EXE_loams");
/// Every setting `loams phone` reads from the environment: a test sets exactly the ones it means to.
const SETTINGS: [&str; 6] = [
    "LOAMS_SERVER",
    "LOAMS_TOKEN",
    "LOAMS_ORG",
    "LOAMS_PHONE_DIR",
    "XDG_DATA_HOME",
    "HOME",
];

struct Server {
    stack: Stack,
    sandbox: SandboxHandle,
    org: String,
    run_id: String,
}

impl Server {
    /// The demo's stack, with one run opened by the sandbox's GlitchTip alert.
    async fn start(data_dir: &Path) -> Server {
        let scenario = Scenario::demo(data_dir.to_path_buf());
        let (sandbox, stack) = demo::start(&scenario).await.unwrap();
        let run_id = post_alert(&stack, &sandbox, &scenario.config)
            .await
            .unwrap();
        Server {
            stack,
            sandbox,
            org: scenario.config.org,
            run_id,
        }
    }

    fn token(&self, user: &str) -> String {
        self.stack.token(user, &self.org).unwrap()
    }

    fn merges(&self) -> u64 {
        self.sandbox.counts().forgejo.merges
    }

    /// The settings of a `loams phone` of `token` keeping its key and cache in `dir`, as environment variables.
    fn env<'a>(&'a self, token: &'a str, dir: &'a Path) -> [(&'static str, &'a str); 3] {
        [
            ("LOAMS_SERVER", self.stack.api_url.as_str()),
            ("LOAMS_TOKEN", token),
            ("LOAMS_PHONE_DIR", dir.to_str().unwrap()),
        ]
    }

    async fn stop(self) {
        self.stack.shutdown().await;
        self.sandbox.shutdown().await;
    }
}

struct Ran {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl std::fmt::Display for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stdout:\n{}\nstderr:\n{}", self.stdout, self.stderr)
    }
}

/// `loams phone <args>` with exactly the settings `env` gives, and no terminal on stdin. One that hangs is killed
/// and reported with what it had printed.
async fn phone(env: &[(&str, &str)], args: &[&str]) -> Ran {
    use tokio::io::AsyncReadExt;
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("phone")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for name in SETTINGS {
        cmd.env_remove(name);
    }
    cmd.envs(env.iter().copied());
    let mut child = cmd.spawn().unwrap();
    let collect = |mut pipe: Box<dyn tokio::io::AsyncRead + Send + Unpin>| {
        tokio::spawn(async move {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text).await;
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = collect(Box::new(child.stdout.take().unwrap()));
    let stderr = collect(Box::new(child.stderr.take().unwrap()));
    let status = tokio::time::timeout(Duration::from_secs(120), child.wait()).await;
    if status.is_err() {
        child.kill().await.unwrap();
    }
    let ran = Ran {
        ok: matches!(&status, Ok(Ok(s)) if s.success()),
        stdout: stdout.await.unwrap(),
        stderr: stderr.await.unwrap(),
    };
    assert!(
        status.is_ok(),
        "loams phone {args:?} did not end within 120 s: {ran}"
    );
    ran
}

/// Lists the approvals until one of `action` (`agent.skill`) is pending, and returns its id and the listing.
async fn wait_for_approval(env: &[(&str, &str)], action: &str) -> (String, String) {
    let deadline = Instant::now() + Duration::from_secs(90);
    let wanted = format!("  action:    {action} ");
    loop {
        let listed = phone(env, &["approvals"]).await;
        assert!(listed.ok, "{listed}");
        let mut id = None;
        for line in listed.stdout.lines() {
            if let Some(shown) = line.strip_prefix("approval ") {
                id = Some(shown);
            } else if line.starts_with(&wanted)
                && let Some(id) = id
            {
                return (id.to_string(), listed.stdout.clone());
            }
        }
        // Nothing of the kind yet: the listing is either approvals or says there are none.
        assert!(
            id.is_some() || listed.stdout.contains("no pending approvals"),
            "{listed}"
        );
        assert!(
            Instant::now() < deadline,
            "no {action} approval within 90 s: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_registers_lists_the_merge_approves_it_with_the_phrase_and_watches_the_run_end() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server")).await;
    let token = server.token("alice");
    let phone_dir = dir.path().join("phone");
    let env = server.env(&token, &phone_dir);

    let registered = phone(&env, &["register", "--name", "alice-laptop"]).await;
    assert!(registered.ok, "{registered}");
    assert!(
        registered
            .stdout
            .contains("registered for alice as \"alice-laptop\""),
        "{registered}"
    );
    // The key is kept in the data directory: a second start registers the same device, not a new one.
    let again = phone(&env, &["register", "--name", "alice-laptop"]).await;
    assert!(again.ok, "{again}");
    let device = |out: &str| out.split_whitespace().nth(1).unwrap().to_string();
    assert_eq!(device(&registered.stdout), device(&again.stdout));

    let (approval, listing) = wait_for_approval(&env, "forgejo.merge").await;
    for context in [
        format!("run:       {}", server.run_id),
        "action:    forgejo.merge (destructive)".to_string(),
        "to approve, type: merge #1".to_string(),
        "summary:   Merge PR #1".to_string(),
        "by agent:loams-factory on behalf of oncall".to_string(),
    ] {
        assert!(listing.contains(&context), "{context:?} in {listing}");
    }

    // Before deciding, the approver looks at what the run made, read from the apps through Loams.
    let panels = phone(&env, &["panels", &server.run_id]).await;
    assert!(panels.ok, "{panels}");
    for line in [
        "  issue:  OPS-",
        "  pr:     #1 ",
        "[open] factory/",
        "  checks: success at ",
        "  thread: #",
        "  error:  ",
        "[unresolved]",
        "  metric: checkout_error total ",
    ] {
        assert!(panels.stdout.contains(line), "{line:?} in {panels}");
    }
    assert!(
        !panels.stdout.contains("- ("),
        "every panel was read: {panels}"
    );
    let unknown = phone(&env, &["panels", "r-0000000000000000"]).await;
    assert!(!unknown.ok, "{unknown}");
    assert!(
        unknown
            .stdout
            .contains("  pr:     - (not found: run r-0000000000000000 not found)"),
        "{unknown}"
    );
    assert!(
        unknown
            .stderr
            .contains("no panel of run r-0000000000000000 could be read"),
        "{unknown}"
    );

    // Nobody at a terminal to type the phrase, and a wrong phrase: nothing is signed.
    let untyped = phone(&env, &["approve", &approval]).await;
    assert!(!untyped.ok, "{untyped}");
    assert!(
        untyped.stderr.contains("pass --confirm \"merge #1\""),
        "{untyped}"
    );
    let mistyped = phone(&env, &["approve", &approval, "--confirm", "merge #2"]).await;
    assert!(!mistyped.ok, "{mistyped}");
    assert!(
        mistyped
            .stderr
            .contains("the typed confirmation does not match the phrase \"merge #1\""),
        "{mistyped}"
    );
    assert_eq!(server.merges(), 0);

    let approved = phone(&env, &["approve", &approval, "--confirm", "merge #1"]).await;
    assert!(approved.ok, "{approved}");
    assert!(
        approved.stdout.contains(&format!(
            "approved {approval} (forgejo.merge), signed by device {}",
            device(&registered.stdout)
        )),
        "{approved}"
    );

    let watched = phone(&env, &["watch", &server.run_id]).await;
    assert!(watched.ok, "{watched}");
    for line in [
        "approval_settled       approved by alice",
        "merged ",
        "verdict: resolved",
        &format!("run {} ended succeeded [resolved]", server.run_id),
    ] {
        assert!(watched.stdout.contains(line), "{line:?} in {watched}");
    }
    assert_eq!(server.merges(), 1);

    let after = phone(&env, &["approvals"]).await;
    assert!(after.stdout.contains("no pending approvals"), "{after}");
    let twice = phone(&env, &["approve", &approval, "--confirm", "merge #1"]).await;
    assert!(!twice.ok, "{twice}");
    assert!(twice.stderr.contains("is no longer pending"), "{twice}");
    // A run the server does not know ends the watch at once: retrying cannot help.
    let unknown = phone(&env, &["watch", "r-0000000000000000"]).await;
    assert!(!unknown.ok, "{unknown}");
    assert!(
        unknown
            .stderr
            .contains("the watch of run r-0000000000000000 stopped: not found"),
        "{unknown}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_merge_ends_the_run_without_merging() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server")).await;
    let token = server.token("bob");
    let phone_dir = dir.path().join("phone");
    // The settings as flags this time, the organisation named explicitly.
    let flags = [
        "--server",
        server.stack.api_url.as_str(),
        "--token",
        token.as_str(),
        "--org",
        server.org.as_str(),
        "--data-dir",
        phone_dir.to_str().unwrap(),
    ];
    fn with<'a>(flags: &[&'a str], args: &[&'a str]) -> Vec<&'a str> {
        [flags, args].concat()
    }

    let registered = phone(&[], &with(&flags, &["register"])).await;
    assert!(registered.ok, "{registered}");
    let env = server.env(&token, &phone_dir);
    let (approval, _) = wait_for_approval(&env, "forgejo.merge").await;

    let denied = phone(&[], &with(&flags, &["deny", &approval])).await;
    assert!(denied.ok, "{denied}");
    assert!(
        denied
            .stdout
            .contains(&format!("denied {approval} (forgejo.merge)")),
        "{denied}"
    );

    // The abandoned run cleans up after itself, and closing the pull request is destructive too.
    let (close, listing) = wait_for_approval(&env, "forgejo.close_pr").await;
    assert_ne!(close, approval);
    assert!(
        listing.contains("action:    forgejo.close_pr (destructive)"),
        "{listing}"
    );
    let closed = phone(
        &[],
        &with(&flags, &["approve", &close, "--confirm", "close #1"]),
    )
    .await;
    assert!(closed.ok, "{closed}");

    let watched = phone(&[], &with(&flags, &["watch", &server.run_id])).await;
    assert!(watched.ok, "{watched}");
    for line in [
        "approval_settled       denied by bob",
        "stopped: approval_denied",
        &format!("run {} ended failed", server.run_id),
    ] {
        assert!(watched.stdout.contains(line), "{line:?} in {watched}");
    }
    assert!(!watched.stdout.contains(" merged "), "{watched}");
    assert_eq!(server.merges(), 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_killed_from_the_phone_stops_at_its_next_step() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("server")).await;
    let token = server.token("carol");
    let phone_dir = dir.path().join("phone");
    let env = server.env(&token, &phone_dir);

    // The kill is signed, so it needs the device key first.
    let unregistered = phone(&env, &["kill", &server.run_id]).await;
    assert!(!unregistered.ok, "{unregistered}");
    assert!(
        unregistered.stderr.contains("loams phone register"),
        "{unregistered}"
    );
    assert!(phone(&env, &["register"]).await.ok);
    // Killed while its merge waits for approval: the pull request is open by then.
    let (merge, _) = wait_for_approval(&env, "forgejo.merge").await;
    let killed = phone(&env, &["kill", &server.run_id, "--reason", "wrong fix"]).await;
    assert!(killed.ok, "{killed}");
    assert!(
        killed
            .stdout
            .contains(&format!("kill switch set for run {}", server.run_id)),
        "{killed}"
    );
    // Compensation closes the pull request, which is destructive: a person approves it.
    let (close, listing) = wait_for_approval(&env, "forgejo.close_pr").await;
    assert_ne!(close, merge);
    assert!(listing.contains("forgejo.close_pr"), "{listing}");
    let closed = phone(&env, &["approve", &close, "--confirm", "close #1"]).await;
    assert!(closed.ok, "{closed}");

    let watched = phone(&env, &["watch", &server.run_id]).await;
    assert!(watched.ok, "{watched}");
    for line in [
        "stopped: killed",
        &format!("run {} ended killed", server.run_id),
    ] {
        assert!(watched.stdout.contains(line), "{line:?} in {watched}");
    }
    assert_eq!(server.merges(), 0);
    server.stop().await;
}

/// A command that must fail: the settings given in the environment, the arguments, and what the error must say.
type Refused<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], &'a str);

#[tokio::test]
async fn missing_or_wrong_settings_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    // Nothing listens on the discard port; none of these commands gets as far as a request anyway.
    let server = "http://127.0.0.1:9";
    // A token shaped like the dev issuer's, naming organisation `acme`; its signature is never checked here.
    let token = "e30.eyJzdWIiOiJhbGljZSIsIm9yZyI6ImFjbWUifQ.sig";

    let cases: [Refused; 7] = [
        (
            &[],
            &["approvals"],
            "setting `server` is missing: pass --server or set LOAMS_SERVER",
        ),
        (
            &[("LOAMS_SERVER", server)],
            &["approvals"],
            "setting `token` is missing: pass --token or set LOAMS_TOKEN",
        ),
        (
            &[("LOAMS_SERVER", server), ("LOAMS_TOKEN", "opaque")],
            &["approvals"],
            "setting `org` is missing: pass --org or set LOAMS_ORG",
        ),
        (
            &[("LOAMS_SERVER", server), ("LOAMS_TOKEN", token)],
            &["approvals"],
            "setting `data_dir` is missing: pass --data-dir or set LOAMS_PHONE_DIR",
        ),
        (
            &[("LOAMS_SERVER", "ftp://x"), ("LOAMS_TOKEN", token)],
            &["--data-dir", data, "approvals"],
            "server_url must be an http(s) URL",
        ),
        (
            &[("LOAMS_SERVER", server), ("LOAMS_TOKEN", token)],
            &["--data-dir", data, "--org", "Acme", "approvals"],
            "setting `org`: invalid input: org \"Acme\" does not match",
        ),
        (
            &[("LOAMS_SERVER", server), ("LOAMS_TOKEN", token)],
            &[
                "--data-dir",
                data,
                "approve",
                "a-1",
                "--confirm",
                "merge #1",
            ],
            "no registered device key: run `loams phone register` first",
        ),
    ];
    for (env, args, expected) in cases {
        let ran = phone(env, args).await;
        assert!(!ran.ok, "{args:?}: {ran}");
        assert!(
            ran.stderr.contains(expected),
            "{args:?}: {expected:?} in {ran}"
        );
    }

    // Settings that are all there but a server that cannot be reached: the cached list, said to be one.
    let offline = phone(
        &[("LOAMS_SERVER", server), ("LOAMS_TOKEN", token)],
        &["--data-dir", data, "approvals"],
    )
    .await;
    assert!(offline.ok, "{offline}");
    assert!(offline.stderr.starts_with("offline ("), "{offline}");
    assert!(offline.stdout.contains("no pending approvals"), "{offline}");

    let usage = phone(&[], &["approve"]).await;
    assert!(!usage.ok, "{usage}");
    assert!(usage.stderr.contains("<APPROVAL>"), "{usage}");
    let unknown = phone(&[], &["approve-all"]).await;
    assert!(!unknown.ok, "{unknown}");
    assert!(
        unknown.stderr.contains("unrecognized subcommand"),
        "{unknown}"
    );
}
