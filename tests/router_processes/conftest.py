"""Fixtures for router end-to-end tests: a tiny checkpoint, the expected-output oracle and
stacks of `epd-sim` engines + `epd-router` as subprocesses on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from epd_kit.preprocess import Preprocessor
from epd_kit.sim.checkpoint import load_checkpoint
from epd_kit.sim.model import expected_tokens
from epd_kit.testing.checkpoint import build_tiny_checkpoint
from tests.hosts.certs import SandboxCa
from tests.vllm_dist import VllmProcess, bench_env, compat_python

from .harness import Stack


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl")


@dataclass
class Oracle:
    """What a correct EPD deployment answers: the sim's pure model over our own rendering."""

    pre: Preprocessor
    ckpt: Path

    def __post_init__(self) -> None:
        self.vocab = load_checkpoint(self.ckpt).vocab
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()  # load tests call the oracle from many threads

    def render(self, messages):
        with self._lock:
            return self._loop.run_until_complete(self.pre.render(messages))

    def expect(self, messages, max_tokens: int):
        rendered = self.render(messages)
        gen = expected_tokens(rendered.token_ids, [i.mm_hash for i in rendered.items], max_tokens, self.vocab)
        # vLLM's text: stepped per token, an open UTF-8 tail left out (preprocess/text.py)
        text = self.pre.detokenizer().push(gen.token_ids)
        return rendered, list(gen.token_ids), gen.finish_reason, text

    def close(self) -> None:
        self._loop.run_until_complete(self.pre.aclose())
        self._loop.close()


@pytest.fixture(scope="session")
def oracle(ckpt) -> Oracle:
    o = Oracle(Preprocessor.from_checkpoint(str(ckpt)), ckpt)
    yield o
    o.close()


@pytest.fixture(scope="module")
def stack(ckpt, tmp_path_factory) -> Stack:
    """3 VEs + 2 PDs + router, shared by the read-only tests of a module."""
    s = Stack.start(ckpt, tmp_path_factory.mktemp("stack"), n_ve=3, n_pd=2)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def sandbox_ca(tmp_path_factory) -> SandboxCa:
    """The CA test_tls.py's router pairs come from; the vLLM process below trusts it."""
    return SandboxCa(tmp_path_factory.mktemp("tls") / "ca")


@pytest.fixture(scope="session")
def vllm_process(sandbox_ca, tmp_path_factory):
    """vllm() -> the session's one vLLM process of the vLLM-compat env (vllm 0.24.0,
    scripts/compat-env.sh), started at its first use, or None while the env is not built (a full
    run builds it beside this lane: each call looks again). test_models.py's and test_tls.py's
    `vllm bench serve` runs share it: each process imports vLLM, ~11 CPU-s. SSL_CERT_FILE is
    `sandbox_ca` from its start (tests/vllm_dist.py _WORKER: aiohttp reads it when imported);
    plain-HTTP runs do not read it. A process that a failed run closed, or that died, is replaced
    at the next use, so one test's failure is not every later one's."""
    started: list[VllmProcess] = []

    def vllm() -> VllmProcess | None:
        if not started or not started[-1].alive:
            python = compat_python()
            if python is None:
                return None
            logs = tmp_path_factory.mktemp("vllm-process")
            started.append(VllmProcess(python, bench_env(SSL_CERT_FILE=str(sandbox_ca.path)), logs))
        return started[-1]

    yield vllm
    for process in started:
        process.close()
