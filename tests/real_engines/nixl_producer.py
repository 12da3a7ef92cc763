"""A VE's half of the kit's NIXL EC connector alone, in a process of its own (no vLLM engine):
its ProducerRegion (NIXL agent, registered region, side channel) holding one item, until killed.

    python -m tests.real_engines.nixl_producer ENGINE_ID HOST PORT SEED

prints READY and a JSON object on one line once it serves ({"agent": ..., "mm_hash": ..., "rows": ..., "blocks": ...}),
then serves until SIGKILL (as a VE's worker dies with its engine). test_nixl_restart.py runs it
in a network namespace, kills it and starts it again with the same engine id and port.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where it runs: the host-free lane collects this tier without it
    import torch

ROWS, WIDTH, BLOCK_TOKENS = 10, 6, 4  # an item of 10 rows in 3 blocks of 4
READY = "EPD NIXL PRODUCER READY "  # its line's prefix (vLLM's log shares stdout)


def item(seed: int) -> torch.Tensor:
    """The item this producer holds: a function of `seed`, so the reader can check its bytes."""
    import torch

    return (torch.arange(ROWS * WIDTH, dtype=torch.float32).view(ROWS, WIDTH) + seed).to(torch.bfloat16)


def main(engine_id: str, host: str, port: int, seed: int) -> None:
    from epd_vllm_plugin.nixl_connector import NixlECConfig, ProducerRegion  # the run's plugin (PYTHONPATH)

    config = NixlECConfig(engine_id, host, port, num_blocks=4, block_tokens=BLOCK_TOKENS, ucx_address=host)
    region = ProducerRegion(config)
    blocks = [0, 1, 2]
    mm_hash = f"item-{seed}"
    region.save(mm_hash, item(seed), blocks)
    ready = {"agent": region.agent.name, "mm_hash": mm_hash, "rows": ROWS, "blocks": blocks}
    print(READY + json.dumps(ready), flush=True)
    signal.pause()  # the side channel's thread serves; SIGKILL ends it


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
