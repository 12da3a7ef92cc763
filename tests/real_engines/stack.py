"""A router (the kit's `epd-router`, from .venv) in front of real vLLM engines on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from epd_kit.testing.images import user_message
from epd_kit.testing.process import ManagedProcess, free_port
from tests.budget import scaled
from tests.router_processes.harness import router_config

from .conftest import PLUGIN, ROUTER
from .engines import HOST, RealEngine

ENGINE_KEY = "real-engine-tier-key-0123456789abcdef"
# The router's waits, sized for CPU engines on a shared 2-core machine: the first request a
# fresh vLLM 0.29 PD served took 23 s once (load ~6, docs/sim.md "Real vLLM"), past the
# default first-token budget (first_token_base_s 15 s, sized for trn2) -> a 504
TIMEOUTS = {
    "connect_s": 1,
    "ve_s": 60,
    "pd_s": 120,
    "total_s": 180,
    "shutdown_grace_s": 10,
    "first_token_base_s": 60,
}
HEALTH = {"interval_s": 0.5, "timeout_s": 2, "failure_threshold": 2, "success_threshold": 1}
# the shared pair's (conftest.py traced_pair)
ENGINE_IMAGES = 2  # the engines' --limit-mm-per-prompt image count; the router's stays 30
PD_MAX_MODEL_LEN = 512  # the PD's --max-model-len; the VE's stays the kit's 8192


def install_plugin(work: Path) -> Path:
    """The kit's engine plugin, pip-installed for this run (a --target directory the engines
    import from) rather than into the shared cached env: two checkouts may differ in it."""
    source, target = work / "src", work / "site"
    shutil.copytree(PLUGIN, source)  # a build writes build/ and *.egg-info beside the sources
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target), str(source)],
        check=True,
    )
    return target


@dataclass
class Client:
    """The openai client on a stack's router, the model it serves (the checkpoint's path) and the
    max_tokens its chats ask for."""

    openai: openai.OpenAI
    model: str
    max_tokens: int

    def chat(
        self, *parts, stream: bool = False, max_tokens: int | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[str | None, str | None, Any]:
        """One chat (`headers`: extra request headers); (text, finish_reason, usage) as the client
        reads them; a stream asks for its usage and must carry it once."""
        request = {
            "model": self.model,
            "messages": [user_message(*parts)],
            "max_tokens": self.max_tokens if max_tokens is None else max_tokens,
            "extra_headers": dict(headers or {}),
        }
        if not stream:
            answer = self.openai.chat.completions.create(**request)
            return answer.choices[0].message.content, answer.choices[0].finish_reason, answer.usage
        text, finish, usages = "", None, []
        events = self.openai.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
        for event in events:
            for choice in event.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
            if event.usage:
                usages.append(event.usage)
        assert len(usages) == 1, usages
        return text, finish, usages[0]


@dataclass
class RealStack:
    workdir: Path
    ckpt: Path
    ves: list[RealEngine]
    pds: list[RealEngine]
    port: int = field(default_factory=free_port)
    router: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def key_file(self) -> Path:
        return self.workdir / "engine-key"

    @classmethod
    def start(
        cls,
        workdir: Path,
        ckpt: Path,
        plugin_site: Path,
        n_ve: int = 1,
        n_pd: int = 1,
        images: int | None = None,
        pd_max_model_len: int | None = None,
        ec_stores: dict[str, Path] | None = None,
        otlp_traces_endpoint: str = "",
        **router_overrides: Any,
    ) -> RealStack:
        """`ec_stores`: engine id -> the EC store directory it gets instead of the one the
        others share (a VE whose embeddings no PD finds: test_missing_block.py).
        `otlp_traces_endpoint`: epd_otlp_traces_endpoint, the engines' and the router's."""
        key_file = workdir / "engine-key"
        key_file.write_text(ENGINE_KEY + "\n")
        key_file.chmod(0o600)
        store = workdir / "ec-store"
        store.mkdir()

        cores = os.cpu_count() or 1

        def engine(role: str, index: int) -> RealEngine:
            return RealEngine(
                role,
                f"epd-{role}-{index}",
                ckpt,
                workdir,
                ec_store=(ec_stores or {}).get(f"epd-{role}-{index}", store),
                key_file=key_file,
                plugin_site=plugin_site,
                images=images,
                max_model_len=pd_max_model_len if role == "pd" else None,
                # VE i and PD i on different cores where there are two
                cpu=(index + (role == "pd")) % cores,
                otlp_traces_endpoint=otlp_traces_endpoint,
            )

        stack = cls(workdir, ckpt, [engine("ve", i) for i in range(n_ve)], [engine("pd", i) for i in range(n_pd)])
        try:
            for one in stack.engines:
                one.start()
            for one in stack.engines:
                one.wait_healthy()
            if otlp_traces_endpoint:  # as the plan's router.yaml (plan/router_config.py)
                router_overrides.setdefault("tracing", {"otlp_traces_endpoint": otlp_traces_endpoint})
            stack.start_router(**router_overrides)
        except BaseException:
            stack.stop()
            raise
        return stack

    @property
    def engines(self) -> list[RealEngine]:
        return self.ves + self.pds

    def start_router(self, **overrides: Any) -> None:
        config = router_config(
            self.ckpt,
            self.ves,  # type: ignore[arg-type]  (engine_id and url are all it reads)
            self.pds,  # type: ignore[arg-type]
            self.port,
            timeouts=TIMEOUTS,
            health=HEALTH,
            engine_auth={"key_file": str(self.key_file)},
            **overrides,
        )
        path = self.workdir / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        self.router = ManagedProcess(
            [str(ROUTER), "serve", "--config", str(path)],
            self.workdir / "router.log",
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            name="router",
        )
        self.router.wait_http(self.url + "/ready", scaled(60))

    @contextlib.contextmanager
    def client(self, max_tokens: int) -> Iterator[Client]:
        """An openai client on the router (no retries: each failure is the test's to see)."""
        with openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=180) as one:
            yield Client(one, str(self.ckpt), max_tokens)

    def pools(self) -> dict[str, dict[str, Any]]:
        doc = httpx.get(self.url + "/pools", timeout=5, trust_env=False).json()
        return {e["id"]: e for e in doc["engines"]}

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop(20)
        for one in self.engines:
            one.stop()
