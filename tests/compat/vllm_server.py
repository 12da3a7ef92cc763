"""vLLM's own OpenAI API server, built from a `vllm serve` argv, on 127.0.0.1.

`vllm_server(argv)` does what `vllm serve` does up to the engine core: vLLM's argv parser and
checks, `AsyncEngineArgs` -> `VllmConfig`, `AsyncLLM`, `build_app` + `init_app_state` (so the
`/inference/v1/generate` and `/v1/chat/completions/render` routes, their request models and
error handlers are vLLM's), served by uvicorn on a free loopback port. Only
`EngineCoreClient.make_async_mp_client` is replaced, by the stand-in of engine_core.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import uvicorn
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.core_client import EngineCoreClient

from epd_kit.testing.process import LOOPBACK, free_port
from tests.compat.engine_core import StandInEngineCore
from tests.compat.vllm_api import (
    build_app,
    build_async_engine_client_from_engine_args,
    init_app_state,
    make_arg_parser,
    validate_parsed_serve_args,
)

__all__ = ["LOOPBACK", "VllmServer", "free_port", "parse_serve_argv", "vllm_server"]


@dataclass
class RecordedBody:
    path: str
    body: dict[str, Any]


@dataclass
class VllmServer:
    url: str
    core: StandInEngineCore
    bodies: list[RecordedBody] = field(default_factory=list)

    @property
    def host_port(self) -> str:
        return self.url.removeprefix("http://")

    def generate_bodies(self) -> list[dict[str, Any]]:
        return [b.body for b in self.bodies if b.path == "/inference/v1/generate"]

    def clear(self) -> None:
        self.bodies.clear()
        self.core.requests.clear()


class _BodyRecorder:
    """ASGI middleware keeping each JSON request body as it arrived on the wire."""

    def __init__(self, app: Any, sink: list[RecordedBody]) -> None:
        self.app, self.sink = app, sink

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        self.sink.append(RecordedBody(scope["path"], json.loads(raw) if raw else {}))
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replay, send)


def parse_serve_argv(argv: Sequence[str]) -> Any:
    """`vllm serve MODEL ...` (argv[0] may be any executable name) through vLLM's parser."""
    if list(argv[1:2]) != ["serve"]:
        raise ValueError(f"not a `vllm serve` command line: {argv[:2]}")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(argv[2:]))
    args.model = args.model_tag or args.model
    validate_parsed_serve_args(args)
    return args


@asynccontextmanager
async def vllm_server(argv: Sequence[str]) -> AsyncIterator[VllmServer]:
    """Serve `argv` (its --host must be loopback) until the context exits."""
    args = parse_serve_argv(argv)
    if args.host != LOOPBACK:
        raise ValueError(f"the compat tier serves on {LOOPBACK} only, not {args.host!r}")
    cores: list[StandInEngineCore] = []

    def stand_in(vllm_config: Any, **_: Any) -> StandInEngineCore:
        cores.append(StandInEngineCore(vllm_config))
        return cores[-1]

    with mock.patch.object(EngineCoreClient, "make_async_mp_client", staticmethod(stand_in)):
        engine_ctx = build_async_engine_client_from_engine_args(AsyncEngineArgs.from_cli_args(args))
        async with engine_ctx as engine:
            tasks = await engine.get_supported_tasks()
            app = build_app(args, tasks, engine.model_config)
            await init_app_state(engine, app.state, args, tasks)
            server = VllmServer(f"http://{LOOPBACK}:{args.port}", cores[0])
            config = uvicorn.Config(
                _BodyRecorder(app, server.bodies), host=LOOPBACK, port=args.port, log_level="warning", lifespan="off"
            )
            uv = uvicorn.Server(config)
            serving = asyncio.create_task(uv.serve())
            while not uv.started:
                if serving.done():
                    serving.result()  # raises the startup error
                await asyncio.sleep(0.01)
            try:
                yield server
            finally:
                uv.should_exit = True
                await serving
