"""epd_vllm_plugin.upstream_nixl's descriptors against vLLM >= 0.30's own helpers: the XferAck
describes an item's runs of blocks (not the VE's region), and the PD pairs them with its own
blocks so that every byte of the item lands in the block upstream's layout puts it in."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from tests.compat.vllm_api import VLLM_SERIES

if tuple(int(part) for part in VLLM_SERIES.split(".")) < (0, 30):
    pytest.skip(f"upstream's NIXL EC connector is vLLM >= 0.30's, this run is {VLLM_SERIES}", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine_plugin" / "src"))
from epd_vllm_plugin.upstream_nixl import block_runs, paired_segments
from vllm.distributed.ec_transfer.ec_connector.cpu.utils import (
    build_block_descs,
    deserialize_mem_descriptor,
    serialize_mem_descriptor,
)

BLOCK = 128  # one embedding row of the tier's checkpoint (64 bf16), as the real engines' region
VE_BASE, PD_BASE = 0x7F00_0000_0000, 0x7E00_0000_0000


def blocks_of(segments: list[tuple[int, int, int]], base: int) -> list[int]:
    """The block index of every BLOCK bytes the segments cover, in order."""
    return [(address - base) // BLOCK for start, size, _ in segments for address in range(start, start + size, BLOCK)]


def test_an_item_of_consecutive_blocks_is_one_descriptor():
    runs = block_runs((VE_BASE, BLOCK), list(range(40, 320)))  # 280 blocks: a 64x48 image (70 rows x 256)
    assert runs == [(VE_BASE + 40 * BLOCK, 280 * BLOCK)]
    ours = serialize_mem_descriptor([(*run, 0) for run in runs])
    upstream = serialize_mem_descriptor(build_block_descs(VE_BASE, (64 << 20) // BLOCK, BLOCK))
    assert len(ours) < 32 and len(upstream) > 6_000_000  # docs/benchmarks.md §14


def test_the_pd_reads_each_block_into_its_own():
    rng = random.Random(54)
    for _ in range(200):
        count = rng.randint(1, 48)
        ve_blocks = sorted(rng.sample(range(256), count))
        pd_blocks = sorted(rng.sample(range(256), count))
        wire = serialize_mem_descriptor([(*run, 0) for run in block_runs((VE_BASE, BLOCK), ve_blocks)])
        local, remote = paired_segments((PD_BASE, BLOCK), pd_blocks, deserialize_mem_descriptor(wire))
        assert [size for _, size, _ in local] == [size for _, size, _ in remote]
        assert blocks_of(local, PD_BASE) == pd_blocks and blocks_of(remote, VE_BASE) == ve_blocks


def test_a_descriptor_of_another_size_is_refused():
    with pytest.raises(ValueError, match="the VE described 256 bytes, 3 blocks of 128 were allocated"):
        paired_segments((PD_BASE, BLOCK), [1, 2, 3], [(VE_BASE, 2 * BLOCK, 0)])
