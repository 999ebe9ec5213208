"""The benchmark's reference agent, written with the official A2A Python SDK (a2a-sdk 1.3.0).

python py_echo_agent.py --port PORT
Same skill as our `serve_agent --agent echo`: a message with the data part
{"skill": "echo", "args": {"text": T}} completes a task with one data artifact {"echo": T}.
JSON-RPC at / (as ours), the SDK's InMemoryTaskStore, uvicorn with access logs off.
"""

import argparse

import uvicorn
from google.protobuf import json_format, struct_pb2
from starlette.applications import Starlette

from a2a.helpers.proto_helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, Part, TaskState


class EchoExecutor(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        if context.current_task is None:
            await event_queue.enqueue_event(
                new_task(context.task_id, context.context_id, TaskState.TASK_STATE_SUBMITTED,
                         history=[context.message])
            )
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        call = json_format.MessageToDict(context.message.parts[0].data)
        if call.get("skill") != "echo":
            await updater.failed()
            return
        out = struct_pb2.Value()
        out.struct_value.update({"echo": call.get("args", {}).get("text")})
        await updater.add_artifact([Part(data=out)], name="output", last_chunk=True)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    card = AgentCard(
        name="echo", description="echoes text", version="1.0.0",
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=["application/json"], default_output_modes=["application/json"],
        skills=[AgentSkill(id="echo", name="Echo", description="returns {\"echo\": text}", tags=["echo"])],
        supported_interfaces=[AgentInterface(protocol_binding="JSONRPC", protocol_version="1.0", url=base)],
    )
    handler = DefaultRequestHandler(agent_executor=EchoExecutor(), task_store=InMemoryTaskStore(), agent_card=card)
    routes = create_agent_card_routes(agent_card=card) + create_jsonrpc_routes(request_handler=handler, rpc_url="/")
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
