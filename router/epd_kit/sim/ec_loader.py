"""PD side of the embedding transfer: handshake once per VE engine_id, READ each item's block,
verify the bytes, all within transfer_timeout_sec (docs/contract.md §3.5)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ..wire import EC_BLOCK_LEN_MISMATCH, EcHandoffItem, EcLocator
from .config import EngineConfig
from .errors import ECLoadFailure
from .model import embedding_bytes
from .profile import LatencyProfile
from .side_channel import request

log = logging.getLogger("epd_sim.ec_connector")
HANDSHAKE_TIMEOUT_S = 5.0  # ZMQ receive timeout of the real handshake


class BlockLenMismatch(ValueError):
    """VE and PD disagree on the encoder-cache block geometry: fatal for the PD."""


@dataclass(frozen=True)
class Peer:
    engine_id: str
    host: str
    port: int
    block_len: int


class _ReadFailed(Exception):
    pass


@dataclass(frozen=True)
class _Source:
    """Where one item is read from, whichever hand-off named it: a locator's VE (its engine_id
    keys the handshake) and blocks, or upstream's producer address, read by mm_hash (vLLM
    0.32.0's consumer asks its peer for the mm_hash, ec_connector/cpu/scheduler/__init__.py)."""

    key: str
    host: str
    port: int
    block_ids: tuple[int, ...] | None

    @classmethod
    def of(cls, item: EcHandoffItem) -> _Source:
        if isinstance(item, EcLocator):
            return cls(item.engine_id, item.host, item.port, tuple(item.remote_block_ids))
        assert item.peer_host is not None and item.peer_port is not None  # pd.py reads readable items only
        return cls(f"{item.peer_host}:{item.peer_port}", item.peer_host, item.peer_port, None)

    @property
    def shown(self) -> str:
        return f"block {list(self.block_ids)} of {self.key}" if self.block_ids else f"the entry at {self.key}"


class EcLoader:
    def __init__(self, cfg: EngineConfig, profile: LatencyProfile) -> None:
        self.cfg = cfg
        self.profile = profile
        # One handshake per engine_id, as the real connector caches it: two VEs sharing an
        # engine_id therefore read from whichever answered first (and fail verification).
        self._peers: dict[str, Peer] = {}
        self._handshakes: dict[str, asyncio.Task[Peer]] = {}

    async def load(self, items: dict[str, EcHandoffItem]) -> dict[str, bytes]:
        """Embedding bytes per mm_hash. Raises ECLoadFailure or BlockLenMismatch."""
        hashes = list(items)
        if not hashes:
            return {}
        locators = {h: _Source.of(item) for h, item in items.items()}
        peers = await self._peers_for(locators)
        timeout = self.cfg.transfer_timeout_s
        if not self.cfg.efa_env_ok:
            # Without FI_EFA_ENABLE_SHM_TRANSFER=0 / FI_EFA_USE_DEVICE_RDMA=1 LIBFABRIC picks
            # the shared-memory path: the READ is posted and never lands.
            await asyncio.sleep(timeout)
            log.error("EC wait_for_load timed out after %.2f s (mm_hashes: %s)", timeout, hashes)
            raise ECLoadFailure(hashes, f"EC wait_for_load timed out after {timeout:.2f} s")
        tasks = {h: asyncio.create_task(self._read(h, locators[h], peers[h])) for h in hashes}
        _done, pending = await asyncio.wait(tasks.values(), timeout=timeout)
        for t in pending:
            t.cancel()
        failed = [h for h, t in tasks.items() if t in pending]
        if failed:
            log.error("EC wait_for_load timed out after %.2f s (outstanding: %s)", timeout, failed)
            raise ECLoadFailure(failed, f"EC wait_for_load timed out after {timeout:.2f} s")
        errors = {h: t.exception() for h, t in tasks.items() if t.exception() is not None}
        if errors:
            for h, exc in errors.items():
                log.error("EC READ of %s failed: %s", h, exc)
            first = next(iter(errors.values()))
            raise ECLoadFailure(list(errors), str(first))
        return {h: t.result() for h, t in tasks.items()}

    async def _peers_for(self, locators: dict[str, _Source]) -> dict[str, Peer]:
        out = {}
        for h, loc in locators.items():
            task = self._handshakes.get(loc.key)
            if task is None or (task.done() and task.exception() is not None):
                task = asyncio.create_task(self._handshake(loc))
                self._handshakes[loc.key] = task
            try:
                out[h] = await asyncio.shield(task)
            except BlockLenMismatch:
                raise
            except Exception as exc:
                msg = f"EC handshake with {loc.key} at {loc.host}:{loc.port} failed: {exc!r}"
                log.error("%s", msg)
                raise ECLoadFailure([h], msg) from exc
        return out

    async def _handshake(self, loc: _Source) -> Peer:
        meta = await asyncio.wait_for(request(loc.host, loc.port, {"op": "get_ec_meta"}), HANDSHAKE_TIMEOUT_S)
        remote_len = int(meta.get("block_len", -1))
        if remote_len != self.cfg.block_len:
            raise BlockLenMismatch(
                f"{EC_BLOCK_LEN_MISMATCH}: remote engine {meta.get('engine_id')} advertises "
                f"{remote_len} bytes/block, local region has {self.cfg.block_len} bytes/block "
                f"(check vision_attention_block_size, dtype and buckets are identical on VE "
                f"and PD)"
            )
        peer = Peer(str(meta.get("engine_id")), loc.host, loc.port, remote_len)
        log.info("EC handshake with %s at %s:%d ok", peer.engine_id, peer.host, peer.port)
        return peer

    async def _read(self, mm_hash: str, loc: _Source, peer: Peer) -> bytes:
        msg: dict = {"op": "read", "tag": mm_hash}
        if loc.block_ids is not None:
            msg["block_ids"] = list(loc.block_ids)
        resp = await request(peer.host, peer.port, msg)
        if resp.get("status") != "DONE":
            raise _ReadFailed(f"transfer state {resp.get('status')}: {resp.get('reason')}")
        blocks = resp.get("blocks") or []
        data = blocks[0] if blocks else b""
        if data != embedding_bytes(mm_hash):
            raise _ReadFailed(
                f"{loc.shown} does not hold {mm_hash} (evicted or reused before the read, or another engine answered)"
            )
        delay = self.profile.transfer_s(peer.block_len * len(blocks))
        if delay:
            await asyncio.sleep(delay)
        return data
