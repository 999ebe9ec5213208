"""The official A2A Python SDK's client against each of our five agents, served as `loams dev`
serves them but on the sandbox apps (serve_agent --sandbox), over both bindings: the signed card
with every skill's risk tag, scopes and the agent's own principal, then one real skill call per
agent (a read skill; plane has none, so it creates an issue in the sandbox), GetTask and ListTasks.

Run through ./run, which builds the agent and sets A2A_SERVE_AGENT to its binary.
"""

import asyncio
import json
import os
import subprocess
import time
import uuid

import httpx
import pytest
from google.protobuf import json_format
from jwt import PyJWK

from a2a.client import ClientConfig, create_client
from a2a.types import GetTaskRequest, ListTasksRequest, Message, SendMessageRequest, TaskState
from a2a.utils.signing import create_signature_verifier

TOKEN = "interop"
BINDINGS = ["JSONRPC", "HTTP+JSON"]
AGENTS = ["zulip", "plane", "forgejo", "glitchtip", "analytics"]
PRINCIPAL_EXTENSION = "https://loams.dev/a2a/ext/principal/v1"
DAY_MS = 86_400_000


def skill_call(agent, sandbox):
    """One real call of each agent against the seeded sandbox apps."""
    now = int(time.time() * 1000)
    return {
        "zulip": ("read", {"channel": sandbox["zulip_channel"], "topic": "interop"}),
        "plane": (
            "create_issue",
            {"external_id": f"interop:{uuid.uuid4()}", "title": "interop", "description": "from a2a-sdk"},
        ),
        "forgejo": ("read_files", {"paths": ["README.md"], "ref": sandbox["forgejo_base"]}),
        "glitchtip": ("issue_events", {"issue_id": str(sandbox["glitchtip_issue_id"]), "since_ms": 0}),
        "analytics": ("series", {"event": "checkout_error", "since_ms": now - 3 * DAY_MS}),
    }[agent]


@pytest.fixture(scope="module", params=AGENTS)
def served(request):
    """Starts one agent on the sandbox; yields (name, url, jwks, sandbox info)."""
    proc = subprocess.Popen(
        [os.environ["A2A_SERVE_AGENT"], "--agent", request.param, "--sandbox"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "SERVE_AGENT_TOKEN": TOKEN},
    )
    try:
        url = proc.stdout.readline().strip().removeprefix("A2A_URL=")
        jwks = json.loads(proc.stdout.readline().strip().removeprefix("A2A_JWKS="))
        sandbox = json.loads(proc.stdout.readline().strip().removeprefix("A2A_SANDBOX="))
        assert url.startswith("http://127.0.0.1:"), url
        yield request.param, url, jwks, sandbox
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def client_for(url, jwks, binding, streaming):
    keys = {k["kid"]: k for k in jwks["keys"]}
    verifier = create_signature_verifier(lambda kid, _jku: PyJWK(keys[kid]), ["ES256"])
    http = httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=20)
    config = ClientConfig(streaming=streaming, supported_protocol_bindings=[binding], httpx_client=http)
    return await create_client(url, client_config=config, signature_verifier=verifier)


def request(skill, args):
    message = json_format.ParseDict(
        {"messageId": f"py-{uuid.uuid4()}", "role": "ROLE_USER",
         "parts": [{"data": {"skill": skill, "args": args}}]},
        Message(),
    )
    return SendMessageRequest(message=message)


def test_card_lists_skills_scopes_and_principal(served):
    name, url, _jwks, _ = served
    card = httpx.get(f"{url}/.well-known/agent-card.json", headers={"A2A-Version": "1.0"}).json()
    assert card["name"] == name
    principal = [e for e in card["capabilities"]["extensions"] if e["uri"] == PRINCIPAL_EXTENSION]
    assert principal[0]["params"]["principal"] == f"agent:{name}"
    for skill in card["skills"]:
        assert skill["description"] and skill["examples"], skill
        risk = [t for t in skill["tags"] if t.startswith("risk:")]
        assert len(risk) == 1, skill
        scopes = skill["securityRequirements"][0]["schemes"]["bearer"]["list"]
        assert f"{name}:{'read' if risk[0] == 'risk:read' else 'write'}" in scopes, skill


@pytest.mark.parametrize("binding", BINDINGS)
@pytest.mark.parametrize("streaming", [False, True])
def test_sdk_client_runs_a_real_skill(served, binding, streaming):
    name, url, jwks, sandbox = served
    skill, args = skill_call(name, sandbox)

    async def go():
        client = await client_for(url, jwks, binding, streaming)
        async with client:
            events = [json_format.MessageToDict(e) async for e in client.send_message(request(skill, args))]
            last = events[-1]
            state = (last.get("task") or last.get("statusUpdate"))["status"]["state"]
            assert state == "TASK_STATE_COMPLETED", events
            task_id = events[0]["task"]["id"]
            got = await client.get_task(GetTaskRequest(id=task_id))
            assert got.status.state == TaskState.TASK_STATE_COMPLETED
            assert got.artifacts[0].parts[0].HasField("data"), got
            listed = await client.list_tasks(ListTasksRequest(page_size=100))
            assert task_id in [t.id for t in listed.tasks]

    run(go())
