"""The official A2A Python SDK's client against our echo agent, over both bindings.

Run through ./run, which builds the agent and sets A2A_SERVE_AGENT to its binary (served as
`serve_agent --agent echo`).
"""

import asyncio
import http.server
import json
import os
import subprocess
import threading
import time
import uuid

import httpx
import pytest
from google.protobuf import json_format
from jwt import PyJWK

from a2a.client import ClientConfig, create_client
from a2a.types import (
    AuthenticationInfo,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import (
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.signing import create_signature_verifier

TOKEN = "interop"
BINDINGS = ["JSONRPC", "HTTP+JSON"]
LIMITS_EXTENSION = "https://loams.dev/a2a/extensions/caller-limits/v1"


@pytest.fixture(scope="module")
def agent():
    """Starts the echo agent; yields (url, jwks) and stops it afterwards."""
    binary = os.environ["A2A_SERVE_AGENT"]
    proc = subprocess.Popen(
        # Push notifications go to a receiver on 127.0.0.1, which the agent refuses by default.
        [binary, "--agent", "echo", "--allow-private-push"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "SERVE_AGENT_TOKEN": TOKEN},
    )
    try:
        url = proc.stdout.readline().strip().removeprefix("A2A_URL=")
        jwks = json.loads(proc.stdout.readline().strip().removeprefix("A2A_JWKS="))
        assert url.startswith("http://127.0.0.1:"), url
        yield url, jwks
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def verifier(jwks):
    keys = {k["kid"]: k for k in jwks["keys"]}
    return create_signature_verifier(lambda kid, _jku: PyJWK(keys[kid]), ["ES256"])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def client_for(agent, binding, streaming):
    url, jwks = agent
    http = httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=20)
    config = ClientConfig(
        streaming=streaming,
        supported_protocol_bindings=[binding],
        httpx_client=http,
    )
    # The SDK verifies our card's JWS (ES256 over the JCS form) with the agent's keys.
    return await create_client(url, client_config=config, signature_verifier=verifier(jwks))


def request(skill, args, return_immediately=False):
    message = json_format.ParseDict(
        {
            "messageId": f"py-{uuid.uuid4()}",
            "role": "ROLE_USER",
            "parts": [{"data": {"skill": skill, "args": args}}],
        },
        Message(),
    )
    req = SendMessageRequest(message=message)
    req.configuration.return_immediately = return_immediately
    return req


def as_dict(msg):
    return json_format.MessageToDict(msg)


async def collect(stream):
    return [as_dict(event) async for event in stream]


@pytest.mark.parametrize("binding", BINDINGS)
def test_send_get_list_cancel(agent, binding):
    async def go():
        client = await client_for(agent, binding, streaming=False)
        async with client:
            events = await collect(client.send_message(request("echo", {"text": "hi"})))
            assert len(events) == 1, events
            task = events[0]["task"]
            assert task["status"]["state"] == "TASK_STATE_COMPLETED"
            assert task["artifacts"][0]["parts"][0]["data"] == {"echo": "hi"}

            got = await client.get_task(GetTaskRequest(id=task["id"], history_length=0))
            assert got.status.state == TaskState.TASK_STATE_COMPLETED
            assert len(got.history) == 0
            full = await client.get_task(GetTaskRequest(id=task["id"]))
            assert full.history[0].message_id == task["id"]

            await collect(client.send_message(request("echo", {"text": "again"})))
            first = await client.list_tasks(ListTasksRequest(page_size=1))
            assert len(first.tasks) == 1 and first.total_size >= 2
            assert first.next_page_token
            second = await client.list_tasks(
                ListTasksRequest(page_size=1, page_token=first.next_page_token)
            )
            assert len(second.tasks) == 1
            assert second.tasks[0].id != first.tasks[0].id
            done = await client.list_tasks(
                ListTasksRequest(status=TaskState.TASK_STATE_COMPLETED, include_artifacts=True)
            )
            assert any(t.id == task["id"] and t.artifacts for t in done.tasks)

            # A finished skill call cannot be canceled; an unknown task is not found.
            with pytest.raises(TaskNotCancelableError):
                await client.cancel_task(CancelTaskRequest(id=task["id"]))
            with pytest.raises(TaskNotFoundError):
                await client.get_task(GetTaskRequest(id="no-such-task"))

    run(go())


@pytest.mark.parametrize("binding", BINDINGS)
def test_stream(agent, binding):
    async def go():
        client = await client_for(agent, binding, streaming=True)
        async with client:
            events = await collect(client.send_message(request("echo", {"text": "streamed"})))
            kinds = [next(iter(e)) for e in events]
            assert kinds == ["task", "artifactUpdate", "statusUpdate"], events
            assert events[1]["artifactUpdate"]["artifact"]["parts"][0]["data"] == {
                "echo": "streamed"
            }
            assert events[2]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"

    run(go())


@pytest.mark.parametrize("binding", BINDINGS)
def test_return_immediately_then_subscribe(agent, binding):
    async def go():
        client = await client_for(agent, binding, streaming=True)
        async with client:
            blocking_off = await client_for(agent, binding, streaming=False)
            async with blocking_off:
                # Long enough that the subscription reaches the task while it runs, on a loaded machine too.
                sent = await collect(
                    blocking_off.send_message(request("sleep", {"ms": 3000}, True))
                )
            task = sent[0]["task"]
            assert task["status"]["state"] == "TASK_STATE_WORKING"
            events = await collect(client.subscribe(SubscribeToTaskRequest(id=task["id"])))
            assert "task" in events[0], events
            assert events[-1]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
            got = await client.get_task(GetTaskRequest(id=task["id"]))
            assert got.status.state == TaskState.TASK_STATE_COMPLETED
            # The task is over: no more updates to subscribe to.
            with pytest.raises(UnsupportedOperationError):
                await collect(client.subscribe(SubscribeToTaskRequest(id=task["id"])))

    run(go())


@pytest.mark.parametrize("binding", BINDINGS)
def test_extended_card(agent, binding):
    async def go():
        client = await client_for(agent, binding, streaming=False)
        async with client:
            card = await client.get_extended_agent_card(
                GetExtendedAgentCardRequest(), signature_verifier=verifier(agent[1])
            )
            ext = card.capabilities.extensions[0]
            assert ext.uri == LIMITS_EXTENSION
            assert ext.params["subject"] == "client"

    run(go())


def test_missing_version_header_is_0_3_and_refused(agent):
    url, _ = agent
    body = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}
    resp = httpx.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.json()["error"]["code"] == -32009
    resp = httpx.get(f"{url}/tasks/x", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 400
    assert resp.json()["error"]["details"][0]["reason"] == "VERSION_NOT_SUPPORTED"


def test_card_cache_headers(agent):
    url, _ = agent
    resp = httpx.get(f"{url}/.well-known/agent-card.json")
    assert resp.status_code == 200
    assert "max-age" in resp.headers["cache-control"]
    again = httpx.get(
        f"{url}/.well-known/agent-card.json", headers={"If-None-Match": resp.headers["etag"]}
    )
    assert again.status_code == 304


@pytest.fixture(scope="module")
def webhooks():
    """A webhook receiver on 127.0.0.1; yields (url, received) with received (path, headers, body)."""
    received = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            received.append((self.path, {k.lower(): v for k, v in self.headers.items()}, json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()


@pytest.mark.parametrize("binding", BINDINGS)
def test_push_notification_configs_and_delivery(agent, webhooks, binding):
    hook_url, received = webhooks
    path = "/jsonrpc" if binding == "JSONRPC" else "/rest"

    async def go():
        client = await client_for(agent, binding, streaming=False)
        async with client:
            # Long enough that the config is stored while the task runs, on a loaded machine too.
            sent = await collect(client.send_message(request("sleep", {"ms": 3000}, True)))
            task_id = sent[0]["task"]["id"]
            config = TaskPushNotificationConfig(
                task_id=task_id,
                id="hook",
                url=hook_url + path,
                token="tok",
                authentication=AuthenticationInfo(scheme="Bearer", credentials="cred"),
            )
            created = await client.create_task_push_notification_config(config)
            assert created.id == "hook" and created.task_id == task_id
            got = await client.get_task_push_notification_config(
                GetTaskPushNotificationConfigRequest(task_id=task_id, id="hook")
            )
            assert got.url == hook_url + path
            listed = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=task_id)
            )
            assert [c.id for c in listed.configs] == ["hook"]

            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                done = [
                    (headers, body)
                    for p, headers, body in list(received)
                    if p == path
                    and body.get("statusUpdate", {}).get("status", {}).get("state")
                    == "TASK_STATE_COMPLETED"
                ]
                if done:
                    break
                await asyncio.sleep(0.05)
            assert done, received
            headers, body = done[0]
            assert body["statusUpdate"]["taskId"] == task_id
            assert headers["authorization"] == "Bearer cred"
            assert headers["x-a2a-notification-token"] == "tok"
            assert headers["content-type"] == "application/a2a+json"

            await client.delete_task_push_notification_config(
                DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="hook")
            )
            listed = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=task_id)
            )
            assert len(listed.configs) == 0

    run(go())


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_our_client_against_an_sdk_server(tmp_path):
    """Our A2aClient (functions/a2a/examples/a2a_probe.rs) against an a2a-sdk agent."""
    port = free_port()
    jwks_file = tmp_path / "jwks.json"
    here = os.path.dirname(__file__)
    server = subprocess.Popen(
        [os.sys.executable, os.path.join(here, "peer_server.py"), "--port", str(port),
         "--jwks-out", str(jwks_file)]
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/.well-known/agent-card.json").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        probe = subprocess.run(
            [os.environ["A2A_PROBE"], f"http://127.0.0.1:{port}", jwks_file.read_text()],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.split() == ["ok", "jsonrpc", "ok", "rest"], probe.stdout
    finally:
        server.terminate()
        server.wait(timeout=10)
