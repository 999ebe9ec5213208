"""The generated Python bindings of loams-ffi against a real `loams dev` server (started by tests/bindings/run,
which passes it in LOAMS_API, LOAMS_ORG, LOAMS_TOKEN, LOAMS_RUN_ID, LOAMS_ALERT_URL, LOAMS_SECOND_ALERT and
LOAMS_DEV_PID).

The device key is a Python implementation of the DeviceSigner foreign trait (the `cryptography` package), as a
phone's is a Secure Enclave or StrongBox one; the token provider and the listeners are Python objects too.
"""

import asyncio
import json
import os
import queue
import signal
import socket
import time
import urllib.parse
import urllib.request

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

import loams_ffi as loams

API = os.environ["LOAMS_API"]
ORG = os.environ["LOAMS_ORG"]
TOKEN = os.environ["LOAMS_TOKEN"]
RUN_ID = os.environ["LOAMS_RUN_ID"]
ALERT_URL = os.environ["LOAMS_ALERT_URL"]
SECOND_ALERT = os.environ["LOAMS_SECOND_ALERT"].encode()
DEV_PID = int(os.environ["LOAMS_DEV_PID"])
TIMEOUT = 90.0


class Signer(loams.DeviceSigner):
    def __init__(self):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.signed = []

    async def public_key(self):
        return self.key.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )

    async def sign(self, message):
        self.signed.append(message)
        return self.key.sign(message, ec.ECDSA(hashes.SHA256()))


class Tokens(loams.TokenProvider):
    async def access_token(self):
        return TOKEN


class Collect(loams.RunListener, loams.ApprovalListener):
    """Called on a Rust worker thread; the test reads the queue from the event loop."""

    def __init__(self):
        self.updates = queue.Queue()
        self.seen = []

    def on_update(self, update):
        self.updates.put(update)

    async def until(self, what, want):
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                update = self.updates.get_nowait()
            except queue.Empty:
                # Yield to the loop: the core's token and signer calls from its worker threads run on it.
                await asyncio.sleep(0.02)
                continue
            self.seen.append(update)
            if want(update):
                return update
        pytest.fail(f"no {what} within {TIMEOUT:.0f} s; seen: {[str(u) for u in self.seen]}")


def has_event(update, kind):
    return update.is_EVENTS() and any(e.kind == kind for e in update.events)


async def stops(task):
    """Waits (up to 5 s: its thread may be slow to get there on a busy machine) for a cancelled watch's task to stop."""
    for _ in range(500):
        if task.is_finished():
            return
        await asyncio.sleep(0.01)
    assert task.is_finished()


def server_down():
    u = urllib.parse.urlparse(API)
    try:
        socket.create_connection((u.hostname, u.port), timeout=0.5).close()
        return False
    except OSError:
        return True


def client(tmp_path, signer):
    settings = loams.ClientSettings(
        server_url=API,
        org=ORG,
        database_path=str(tmp_path / "phone.db"),
        sync_mode=loams.SyncMode.STREAM,
        poll_interval_ms=100,
        request_timeout_ms=5000,
        reconnect_delay_ms=100,
    )
    return loams.Client(settings, Tokens(), signer)


def test_links_route_and_malformed_ones_are_errors():
    assert loams.parse_link("loams://runs/r-1", []) == loams.Route.RUN(run_id="r-1")
    app = loams.AllowedApp(env="production", app="forgejo")
    assert loams.parse_link("loams://app/production/forgejo/pulls/1", [app]) == loams.Route.APP(
        env="production", app="forgejo", path="pulls/1"
    )
    with pytest.raises(loams.LoamsError.NotAllowed):
        loams.parse_link("loams://app/production/plane/x", [app])
    with pytest.raises(loams.LoamsError.InvalidInput):
        loams.parse_link("loams://approvals/a-1?decision=approve", [])


def test_register_watch_approve_then_offline(tmp_path):
    asyncio.run(register_watch_approve_then_offline(tmp_path))


async def register_watch_approve_then_offline(tmp_path):
    # The core calls the async token provider and signer from its own threads: they run on this loop.
    loams.uniffi_set_event_loop(asyncio.get_running_loop())
    signer = Signer()
    phone = client(tmp_path, signer)

    device = await phone.devices().register("alice-python", None)
    assert device.public_key == await signer.public_key()
    assert device.user == "alice"
    again = await phone.devices().register("alice-python", None)
    assert again.device_id == device.device_id, "registering the same key again is idempotent"

    runs = Collect()
    watch = await phone.runs().watch(RUN_ID, runs)
    # The snapshot is delivered before watch() returns: nothing cached yet.
    first = runs.updates.get_nowait()
    assert first == loams.RunUpdate.SNAPSHOT(run=None, events=[])

    approvals = Collect()
    approvals_watch = await phone.approvals().watch_pending(approvals)
    assert approvals.updates.get_nowait() == loams.ApprovalUpdate.SNAPSHOT(approvals=[])

    await runs.until("approval request on the timeline", lambda u: has_event(u, "approval_requested"))
    added = await approvals.until(
        "the approval", lambda u: u.is_ADDED() and u.approval.run_id == RUN_ID
    )
    approval = added.approval
    assert approval.summary, "the server renders the summary"
    assert approval.risk == loams.Risk.DESTRUCTIVE
    phrase = approval.confirmation_phrase
    assert phrase, "a destructive approval asks for a typed phrase"

    # Before deciding, the panels show what the merge would take in: the PR and its CI, read through Loams.
    pr = await phone.panels().pull_request(RUN_ID)
    assert (pr.state, pr.merged) == ("open", False)
    assert pr.head_branch == f"factory/{RUN_ID}"
    checks = await phone.panels().check_runs(RUN_ID)
    assert checks.sha == pr.head_sha and checks.state == "success"
    assert checks.checks and all(c.state == "success" for c in checks.checks)
    with pytest.raises(loams.LoamsError.NotFound):
        await phone.panels().pull_request("r-0000000000000000")
    apps = {a.id: a for a in await phone.panels().apps()}
    assert list(apps) == ["zulip", "plane", "forgejo", "glitchtip", "analytics"]
    assert all(a.configured and a.readable for a in apps.values())
    forgejo = apps["forgejo"]
    templates = {t.object: t.template for t in forgejo.deep_link_templates}
    assert templates["pull_request"].replace("{number}", str(pr.number)) == pr.url
    assert pr.url.startswith(forgejo.base_url + "/")
    assert apps["analytics"].base_url == "" and not apps["analytics"].deep_link_templates

    # A wrong phrase is refused before anything is signed or sent.
    with pytest.raises(loams.LoamsError.ConfirmationMismatch) as err:
        await phone.approvals().decide(approval.id, loams.Decision.APPROVE, "yes")
    assert err.value.phrase == phrase
    assert signer.signed == []
    assert phone.approvals().cached(approval.id).state == loams.ApprovalState.PENDING

    # Decided as shown (the watch delivered it): signed over what the person saw, without reading it again.
    decided = await phone.approvals().decide_shown(approval, loams.Decision.APPROVE, phrase)
    assert decided.state == loams.ApprovalState.APPROVED
    assert decided.decision == loams.Decision.APPROVE
    assert decided.decided_by == "alice"
    assert len(signer.signed) == 1, "the Python signer signed the decision once"
    await approvals.until(
        "the approval to leave the list", lambda u: u == loams.ApprovalUpdate.REMOVED(approval_id=approval.id)
    )

    # The run goes on past the approval to the merge and the end.
    await runs.until("the merge", lambda u: has_event(u, "merged"))
    await runs.until("the end of the run", lambda u: u.is_FINISHED())
    assert watch.is_finished(), "finished as soon as it says so"
    seqs = [e.seq for u in runs.seen if u.is_EVENTS() for e in u.events]
    assert seqs == list(range(1, len(seqs) + 1)), "each event once, in order"
    run = phone.runs().cached_run(RUN_ID)
    assert run.state == "succeeded"
    assert run.version == len(seqs)
    assert run.confirmed_at_ms > 0

    # Killing a run is a signed step-up too: the alert posted again opens a run, which is killed while its merge
    # waits for approval, with canonical kill bytes the Python signer signs.
    posted = urllib.request.Request(ALERT_URL, data=SECOND_ALERT, headers={"content-type": "application/json"})
    with urllib.request.urlopen(posted, timeout=30) as r:
        second_run = json.load(r)["run"]
    await approvals.until(
        "the second run's approval", lambda u: u.is_ADDED() and u.approval.run_id == second_run
    )
    killed = await phone.runs().kill(second_run, "not this one")
    assert killed.id == second_run
    assert len(signer.signed) == 2
    assert signer.signed[1].startswith(b"loams.factory.kill.v1\x00")
    second = Collect()
    second_watch = await phone.runs().watch(second_run, second)
    await second.until("the kill to stop the run", lambda u: has_event(u, "abandoned"))
    second_watch.cancel()
    # A run that has ended cannot be killed: the server refuses the kill challenge, so nothing is signed.
    with pytest.raises(loams.LoamsError.Rejected) as err:
        await phone.runs().kill(RUN_ID, "seen enough")
    assert "already ended (succeeded)" in err.value.detail
    assert len(signer.signed) == 2

    # The server goes away.
    os.kill(DEV_PID, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not server_down():
        assert time.monotonic() < deadline, "the server did not stop"
        await asyncio.sleep(0.05)

    runs_before = phone.runs().cached(100)
    timeline_before = phone.runs().cached_timeline(RUN_ID, 0, 10_000)
    approval_before = phone.approvals().cached(approval.id)
    assert len(timeline_before) == len(seqs)

    started = time.monotonic()
    with pytest.raises(loams.LoamsError.Offline):
        await phone.approvals().decide(approval.id, loams.Decision.DENY, None)
    with pytest.raises(loams.LoamsError.Offline):
        await phone.runs().kill(RUN_ID, "stop")
    with pytest.raises(loams.LoamsError.Offline):
        await phone.approvals().refresh_pending()
    elapsed = time.monotonic() - started
    assert elapsed < 2.0, f"offline calls fail at once, took {elapsed:.2f} s"
    assert len(signer.signed) == 2, "nothing was signed offline"

    phone.set_network_available(False)
    with pytest.raises(loams.LoamsError.Offline) as err:
        await phone.runs().kill(RUN_ID, "stop")
    assert err.value.detail == "no network connection"

    assert phone.runs().cached(100) == runs_before, "the cache is unchanged"
    assert phone.runs().cached_timeline(RUN_ID, 0, 10_000) == timeline_before
    assert phone.approvals().cached(approval.id) == approval_before
    assert phone.devices().current().device_id == device.device_id

    # Offline, a watch still delivers the cached snapshot, then says it is offline.
    offline = Collect()
    offline_watch = await phone.runs().watch(RUN_ID, offline)
    snapshot = offline.updates.get_nowait()
    followed = next(r for r in runs_before if r.id == RUN_ID)
    assert snapshot == loams.RunUpdate.SNAPSHOT(run=followed, events=timeline_before)
    notice = await offline.until("the offline notice", lambda u: True)
    assert notice.is_CONNECTION() and not notice.connected
    offline_watch.cancel()
    approvals_watch.cancel()
    await stops(approvals_watch)
