#!/usr/bin/env python3
"""Starts and stops a real Loams server for the binding tests (standard library only).

`stack.py start DIR` runs the sandbox apps (`loams sandbox`) and `loams dev` on 127.0.0.1 (free ports, the demo's
replayed model, auto-triage, short observe window), opens one run with the sandbox's GlitchTip alert, and prints
shell `export` lines: LOAMS_API, LOAMS_ORG, LOAMS_TOKEN (alice), LOAMS_RUN_ID, LOAMS_ALERT_URL and LOAMS_SECOND_ALERT
(the alert again, which the tests post to open a run they kill), LOAMS_DEV_PID (the tests stop the
server through it to show the offline behaviour). `stack.py stop DIR` ends whatever of the two is still running.
The processes are started in their own sessions so that they outlive this helper; their pids are kept in DIR.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOAMS = ROOT / "target" / "debug" / "loams"
CASSETTE = ROOT / "functions" / "loams" / "demo" / "cassette.json"
ORG = "acme"
WEBHOOK_TOKEN = "bindings-test-webhook-token-0123456789"


def wait_for(what, check, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"stack.py: {what} did not happen within {timeout:.0f} s")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args, log, pidfile):
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env={**os.environ, "LOAMS_LOG": "warn"},
            start_new_session=True,
        )
    pidfile.write_text(str(proc.pid))
    return proc


def config(d, port, info):
    t, u = info["tokens"], info["urls"]
    return f"""listen = "127.0.0.1:{port}"
data_dir = "{d / 'data'}"
org = "{ORG}"
webhook_token = "{WEBHOOK_TOKEN}"

[model]
cassette = "{d / 'cassette.json'}"

[policy]
auto_triage = true

[factory]
observe_window_ms = 1500
ci_poll_ms = 100
# The tests post the alert again to open a second run, which they kill.
cooldown_ms = 0

[apps.zulip]
url = "{u['zulip']}"
email = "{t['zulip_email']}"
api_key = "{t['zulip_api_key']}"

[apps.plane]
url = "{u['plane']}"
api_key = "{t['plane_api_key']}"
workspace = "{info['plane_workspace']}"
project_id = "{info['plane_project_id']}"

[apps.forgejo]
url = "{u['forgejo']}"
token = "{t['forgejo_token']}"
owner = "{info['forgejo_owner']}"
repo = "{info['forgejo_repo']}"
base = "{info['forgejo_base']}"

[apps.glitchtip]
url = "{u['glitchtip']}"
token = "{t['glitchtip_token']}"
org = "{info['glitchtip_org']}"

[apps.analytics]
url = "{u['openpanel']}"
client_id = "{t['openpanel_client_id']}"
client_secret = "{t['openpanel_client_secret']}"
project_id = "{info['openpanel_project_id']}"
"""


def up(url):
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def alert(info, issue_id, text="checkout.apply_discount"):
    """The GlitchTip alert for `issue_id`, as GlitchTip posts it."""
    return {
        "alias": "GlitchTip",
        "text": "GlitchTip Alert",
        "attachments": [
            {
                "title": "ZeroDivisionError: division by zero",
                "title_link": f"{info['urls']['glitchtip']}/{info['glitchtip_org']}/issues/{issue_id}",
                "text": text,
                "fields": [],
            }
        ],
    }


def start_dev(d, cfg, info, attempts=3):
    """`loams dev` on a free port, and its API's URL. The port is free when chosen but may be taken before the
    server binds it (its own agents bind ports too): a server that exits saying so is started again on another."""
    log = d / "dev.log"
    for _ in range(attempts):
        port = free_port()
        api = f"http://127.0.0.1:{port}"
        cfg.write_text(config(d, port, info))
        logged = log.stat().st_size if log.exists() else 0
        dev = spawn([LOAMS, "dev", "--config", cfg], log, d / "dev.pid")
        wait_for(f"the API at {api}", lambda: dev.poll() is not None or up(f"{api}/.well-known/jwks.json"))
        if dev.poll() is None:
            return dev, api
        with open(log, "rb") as f:
            f.seek(logged)
            said = f.read().decode(errors="replace")
        if "in use" not in said:
            break
    raise SystemExit(f"stack.py: loams dev exited (code {dev.returncode}):\n{said[-4000:]}")


def start(d):
    d.mkdir(parents=True, exist_ok=True)
    urls = d / "urls.json"
    spawn([LOAMS, "sandbox", "--state", d / "sandbox.json", "--urls-file", urls], d / "sandbox.log", d / "sandbox.pid")
    info = json.loads(wait_for("the sandbox apps", lambda: urls.exists() and urls.read_text()))
    # The demo's recorded completions twice over: one set for each run the tests open.
    demo = json.loads(CASSETTE.read_text())
    (d / "cassette.json").write_text(json.dumps({"completions": demo["completions"] * 2}))
    cfg = d / "loams.toml"
    dev, api = start_dev(d, cfg, info)
    token = subprocess.run(
        [LOAMS, "token", "--config", cfg, "--user", "alice"], check=True, capture_output=True, text=True
    ).stdout.strip()
    alert_url = f"{api}/webhooks/glitchtip/{WEBHOOK_TOKEN}"
    req = urllib.request.Request(
        alert_url,
        data=json.dumps(alert(info, info["glitchtip_issue_id"])).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        body = json.load(r)
    run_id = body.get("run")
    if not run_id:
        raise SystemExit(f"stack.py: the alert opened no run: {body}")
    # The issue alerting again (other bytes, so not a resend), which the tests post to open a run they kill: with no
    # cooldown, it opens a new run once the first has ended.
    second_alert = json.dumps(alert(info, info["glitchtip_issue_id"], "checkout.apply_discount (again)"))
    for k, v in [("LOAMS_API", api), ("LOAMS_ORG", ORG), ("LOAMS_TOKEN", token), ("LOAMS_RUN_ID", run_id),
                 ("LOAMS_ALERT_URL", alert_url), ("LOAMS_SECOND_ALERT", second_alert), ("LOAMS_DEV_PID", dev.pid)]:
        print(f"export {k}={shlex.quote(str(v))}")



def stop(d):
    for name in ("dev", "sandbox"):
        pidfile = d / f"{name}.pid"
        if not pidfile.exists():
            continue
        pid = int(pidfile.read_text())
        pidfile.unlink()
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        # Not our child any more once the starting helper exited: wait until it is gone.
        def gone():
            try:
                os.kill(pid, 0)
                return False
            except ProcessLookupError:
                return True
        wait_for(f"{name} (pid {pid}) to stop", gone, timeout=10)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "stop"):
        raise SystemExit("usage: stack.py start|stop DIR")
    (start if sys.argv[1] == "start" else stop)(Path(sys.argv[2]).resolve())
