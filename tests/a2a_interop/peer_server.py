"""An echo agent written with the official A2A Python SDK, for our client to talk to.

python peer_server.py --port PORT --jwks-out FILE
Serves JSON-RPC at /a2a/jsonrpc and HTTP+JSON at /a2a/rest; the card is signed (ES256, kid
"py-peer") and the public key set is written to FILE.
"""

import argparse
import json

import uvicorn
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm
from starlette.applications import Starlette

from a2a.helpers.proto_helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Part,
    TaskState,
)
from a2a.utils.signing import create_agent_card_signer


class EchoExecutor(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        if context.current_task is None:
            await event_queue.enqueue_event(
                new_task(
                    context.task_id,
                    context.context_id,
                    TaskState.TASK_STATE_SUBMITTED,
                    history=[context.message],
                )
            )
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        await updater.add_artifact(
            [Part(text=f"echo: {context.get_user_input()}")], name="echo", last_chunk=True
        )
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--jwks-out", required=True)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"

    key = ec.generate_private_key(ec.SECP256R1())
    jwk = json.loads(ECAlgorithm.to_jwk(key.public_key()))
    jwk.update({"kid": "py-peer", "alg": "ES256", "use": "sig"})
    with open(args.jwks_out, "w") as f:
        json.dump({"keys": [jwk]}, f)

    card = AgentCard(
        name="Echo Peer",
        description="a2a-sdk echo peer",
        version="1.0.0",
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="Echo", description="Echoes input", tags=["echo"])],
        supported_interfaces=[
            AgentInterface(protocol_binding="JSONRPC", protocol_version="1.0", url=f"{base}/a2a/jsonrpc"),
            AgentInterface(protocol_binding="HTTP+JSON", protocol_version="1.0", url=f"{base}/a2a/rest"),
        ],
    )
    sign = create_agent_card_signer(key, {"alg": "ES256", "kid": "py-peer", "typ": "JOSE"})
    card = sign(card)

    handler = DefaultRequestHandler(
        agent_executor=EchoExecutor(), task_store=InMemoryTaskStore(), agent_card=card
    )
    routes = (
        create_agent_card_routes(agent_card=card)
        + create_jsonrpc_routes(request_handler=handler, rpc_url="/a2a/jsonrpc")
        + create_rest_routes(request_handler=handler, path_prefix="/a2a/rest")
    )
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
