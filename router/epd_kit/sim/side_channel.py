"""Stand-in for the NIXL side channel + RDMA READ between a PD (client) and a VE (server).

Framing: 4-byte big-endian length, then one msgpack map. Requests:
  {"op": "get_ec_meta"}                        -> handshake: engine_id, num_blocks, block_len, ...
  {"op": "read", "block_ids": [..], "tag": h}  -> {"status": "DONE", "blocks": [bytes, ...]}
  {"op": "read", "tag": h}                     -> the same, for the block that holds item h
                                                  (upstream's ec_transfer_params names no blocks)
A read that the transport cannot complete (EFA env missing, `hang` fault) never answers; a
refused read answers {"status": "ERR", ...}. The PD's transfer timeout does the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable
from typing import Any

import msgpack

from .encoder_cache import EncoderCache
from .faults import Faults

log = logging.getLogger("epd_sim.side_channel")
_HDR = struct.Struct(">I")
MAX_FRAME = 64 << 20


async def send_msg(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    writer.write(_HDR.pack(len(data)) + data)
    await writer.drain()


async def recv_msg(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _HDR.unpack(await reader.readexactly(_HDR.size))
    if size > MAX_FRAME:
        raise ValueError(f"side-channel frame of {size} bytes is too large")
    obj = msgpack.unpackb(await reader.readexactly(size), raw=False)
    if not isinstance(obj, dict):
        raise ValueError("side-channel frame must be a msgpack map")
    return obj


class SideChannelServer:
    """VE side: answers handshakes and block reads from the encoder cache."""

    def __init__(
        self,
        *,
        engine_id: str,
        block_len: int,
        cache: EncoderCache,
        efa_env_ok: bool,
        faults: Callable[[], Faults],
    ) -> None:
        self.engine_id = engine_id
        self.block_len = block_len
        self.cache = cache
        self.efa_env_ok = efa_env_ok
        self._faults = faults
        self._server: asyncio.base_events.Server | None = None
        self._peers: set[asyncio.StreamWriter] = set()
        self.reads_served = 0

    def meta(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "agent_metadata": b"epd-sim-agent:" + self.engine_id.encode(),
            "base_addr": 0,
            "num_blocks": self.cache.num_blocks,
            "block_len": self.block_len,
            "device_id": 0,
        }

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._peers):  # a hung read must not block shutdown
                writer.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._peers.add(writer)
        try:
            while True:
                msg = await recv_msg(reader)
                op = msg.get("op")
                if op == "get_ec_meta":
                    await send_msg(writer, self.meta())
                elif op == "read":
                    await self._read(msg, reader, writer)
                else:
                    await send_msg(writer, {"status": "ERR", "reason": f"unknown op {op!r}"})
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as exc:  # a malformed peer must not kill the VE
            log.warning("side channel: dropping peer: %s", exc)
        finally:
            self._peers.discard(writer)
            writer.close()

    async def _read(self, msg: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        faults = self._faults()
        if not self.efa_env_ok or faults.side_channel == "hang":
            # LIBFABRIC picked the shared-memory path (or the transport is wedged): the READ
            # is posted but never completes. Hold the connection until the peer gives up.
            while await reader.read(4096):
                pass
            raise ConnectionResetError("peer gave up on a READ that never completed")
        if faults.side_channel == "refuse":
            await send_msg(writer, {"status": "ERR", "reason": "READ rejected by remote agent"})
            return
        if faults.side_channel == "slow" and faults.side_channel_delay_ms:
            await asyncio.sleep(faults.side_channel_delay_ms / 1000)
        block_ids = msg.get("block_ids")
        if block_ids is None:  # upstream's hand-off names the item, not its blocks: its mm_hash
            found = self.cache.lookup(str(msg.get("tag")))
            if found is None:
                await send_msg(writer, {"status": "ERR", "reason": f"no item {msg.get('tag')}"})
                return
            block_ids = [found]
        blocks = []
        for block_id in block_ids:
            data = self.cache.read(int(block_id))
            if data is None:
                await send_msg(writer, {"status": "ERR", "reason": f"no block {block_id}"})
                return
            blocks.append(data)
        self.reads_served += 1
        await send_msg(writer, {"status": "DONE", "blocks": blocks})


async def request(host: str, port: int, msg: dict[str, Any]) -> dict[str, Any]:
    """One request/response exchange on a fresh connection (the caller bounds the time)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        await send_msg(writer, msg)
        return await recv_msg(reader)
    finally:
        writer.close()
