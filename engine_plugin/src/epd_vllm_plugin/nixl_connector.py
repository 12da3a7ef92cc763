"""The kit's EC connector: encoder outputs from a VE to a PD over NIXL (vLLM 0.24.0 and 0.29.0, CPU).

What vllm-neuron's NeuronNixlECConnector does on trn2 (docs/contract.md §3.5), on a CPU host:

- **VE (ec_producer).** The scheduler gives every item it schedules for encoding blocks of a
  bounded region (`ec_num_blocks` blocks of `ec_block_tokens` embedding rows, a ring); the
  worker copies the item's encoder output into those blocks of a NIXL-registered CPU region and
  serves a side channel (`side_channel_host`:`side_channel_port`, ZMQ REQ/REP, msgpack) that
  hands out its NIXL agent metadata and, per item, the descriptors of that item's blocks only.
  The locator (scheduler.py, ECLocatorScheduler) names those blocks and the item's rows.
- **PD (ec_consumer).** Before a request is scheduled (`ensure_cache_available`), the
  scheduler reads each item's locator from the request's `kv_transfer_params.ec_locator`
  (sampling_params.extra_args, the router's carrier, §3.1), handshakes once per `engine_id`
  and VE incarnation (the VE's agent name; a new one replaces the old in the PD's agent),
  asks the VE for the item's blocks, NIXL READs them (UCX over TCP) and asks again whether the
  blocks still hold that item (a ring block may be reused: a stale read is refused, never
  used). The side-channel round trips (`side_channel_timeout_sec` each) run on the reader's
  own threads: the scheduler looks whether they answered and never waits on a VE. The bytes
  reach the worker's encoder cache through the connector metadata. A missing, stale or
  mismatched item fails that request with ECLoadFailure's message (finish_reason
  "error", the message in the PD's log and in the answer's `kv_transfer_params`); the engine
  core lives on (Neuron's PD dies instead, §3.5 item 3).

Why the PD reads in the scheduler process rather than the worker (vLLM's CPU worker is another
process, `platforms/cpu.py` sets the "mp" executor): a failed read there can only fail the
request before it is scheduled; a worker has no per-request failure path for EC loads in 0.24
or 0.29 (its exception kills the engine core). The cost is one copy of the item's bytes from
the scheduler to the worker (pickled with the scheduler output).

Progress: NIXL's UCX progress thread would spin a core on an idle engine (nixl_agent.py); it
is off here. The PD progresses its reads when its scheduler checks them, the VE's side-channel
thread progresses UCX (`get_new_notifs`) only between a PD's item request and its check (a read
window bounded by `transfer_timeout_sec`) and otherwise sleeps in a ZMQ poll.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import zmq

try:  # vLLM internals this module builds on, the same at 0.24.0 and 0.29.0
    from vllm.distributed.ec_transfer.ec_connector.base import (  # base.py: ECConnectorBase, its roles
        ECConnectorBase,
        ECConnectorMetadata,
        ECConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - only on a vLLM without the EC connector API
    import vllm

    raise ImportError(
        f"epd_vllm_plugin.nixl_connector needs vLLM's EC connector API "
        f"(vllm/distributed/ec_transfer/ec_connector/base.py, vLLM 0.24.0 and 0.29.0); "
        f"vLLM {getattr(vllm, '__version__', '?')} has none: {exc}"
    ) from exc

from .compat import CONNECTOR_INTERNALS, require
from .nixl_agent import nixl_agent, set_ucx_device

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# a child of vLLM's "vllm" logger, whose handler (vllm/logger.py) prints to the engine's log
log = logging.getLogger("vllm.epd_nixl_ec")

CONNECTOR_NAME = "EPDNixlECConnector"
MODULE_PATH = __name__
# ECLoadFailure's message (docs/contract.md §3.5 item 3; router/upstream.py EC_LOAD_FAILURE_MARKERS)
LOAD_FAILURE = "ECLoadFailure: Encoder-cache load failed for mm_hashes: {hashes}: {reason}"
# where a failed request's message travels in its answer (the request's kv_transfer_params)
FAILURE_KEY = "ec_load_failure"
ASK_THREADS = 4  # a PD's side-channel round trips in flight at once (each bounded by its timeout)
IDLE_POLL_MS = 1000  # the side channel's wake-up to see a shutdown; no UCX progress then
WINDOW_POLL_MS = 1  # its UCX progress period while a read is open


SLOW_S = 1.0  # a side-channel step this long is logged: the side channel answered nobody meanwhile


def slow(started: float, what: str) -> None:
    """Log a step of the side channel's thread that held it SLOW_S or longer."""
    took = time.monotonic() - started
    if took >= SLOW_S:
        log.warning("EPD NIXL EC producer: %s took %.1f s (the side channel answered nobody meanwhile)", what, took)


class ECLoadFailure(RuntimeError):
    """A PD could not read an item's encoder output (message: LOAD_FAILURE). `lost`: the VE's
    side channel or NIXL connection failed (it may have died or restarted), so the PD drops its
    agent and handshakes again; a refusal from a VE that answered keeps it."""

    def __init__(self, message: str, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost


@dataclass(frozen=True)
class NixlECConfig:
    """ec_connector_extra_config of `--ec-transfer-config`, checked."""

    engine_id: str
    side_channel_host: str | None
    side_channel_port: int | None
    num_blocks: int = 64
    block_tokens: int = 64
    max_region_bytes: int = 256 << 20
    transfer_timeout_s: float = 5.0
    side_channel_timeout_s: float = 2.0  # one round trip with a VE's side channel
    backends: tuple[str, ...] = ("UCX",)
    ucx_address: str | None = None  # the engine's address: UCX_NET_DEVICES is its interface

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> NixlECConfig:
        config = vllm_config.ec_transfer_config
        assert config is not None  # ECConnectorBase.__init__ refuses a missing one

        def extra(key: str, default: Any, kind: type) -> Any:
            value = config.get_from_extra_config(key, default)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(
                    f"{CONNECTOR_NAME}: ec_connector_extra_config.{key} must be a {kind.__name__} (got {value!r})"
                )
            return value

        made = cls(
            engine_id=str(config.engine_id),
            side_channel_host=config.get_from_extra_config("side_channel_host", None),
            side_channel_port=config.get_from_extra_config("side_channel_port", None),
            num_blocks=extra("ec_num_blocks", cls.num_blocks, int),
            block_tokens=extra("ec_block_tokens", cls.block_tokens, int),
            max_region_bytes=extra("ec_max_region_bytes", cls.max_region_bytes, int),
            transfer_timeout_s=extra("transfer_timeout_sec", cls.transfer_timeout_s, float),
            side_channel_timeout_s=extra("side_channel_timeout_sec", cls.side_channel_timeout_s, float),
            backends=tuple(extra("backends", list(cls.backends), list)),
            ucx_address=config.get_from_extra_config("ucx_address", None),
        )
        timeouts = (made.transfer_timeout_s, made.side_channel_timeout_s)
        if min(made.num_blocks, made.block_tokens, made.max_region_bytes) < 1 or min(timeouts) <= 0:
            raise ValueError(f"{CONNECTOR_NAME}: block counts, sizes and timeouts must be positive: {made}")
        if config.is_ec_producer and (
            not made.side_channel_host or not isinstance(made.side_channel_port, int) or made.side_channel_port < 1
        ):
            raise ValueError(
                f"{CONNECTOR_NAME}: a producer needs side_channel_host and an integer side_channel_port in "
                f"ec_connector_extra_config (got {made.side_channel_host!r}, {made.side_channel_port!r})"
            )
        return made


# ---------------------------------------------------------------------------------------------
# what the scheduler hands the worker each step


@dataclass(frozen=True)
class LoadedItem:
    """An item's encoder output as the PD's scheduler read it: raw bytes, dtype and shape."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]


@dataclass
class NixlECMetadata(ECConnectorMetadata):
    saves: dict[str, list[int]] = field(default_factory=dict)  # VE: item -> its blocks
    loads: dict[str, LoadedItem] = field(default_factory=dict)  # PD: item -> its bytes


# ---------------------------------------------------------------------------------------------
# VE


@dataclass
class SavedItem:
    blocks: list[int]
    rows: int
    row_shape: tuple[int, ...]
    dtype: str
    generation: int


class BlockRing:
    """The producer scheduler's block allocator: blocks handed out in turn, the oldest item's
    reused first (a locator can go stale, docs/contract.md §3.5 item 5; the PD's check sees it)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.next = 0
        self.owner: dict[int, str] = {}
        self.items: dict[str, list[int]] = {}

    def allocate(self, mm_hash: str, count: int) -> list[int]:
        if count > self.num_blocks:
            raise ValueError(f"an item of {count} blocks does not fit a region of {self.num_blocks} (ec_num_blocks)")
        blocks = [(self.next + i) % self.num_blocks for i in range(count)]
        self.next = (self.next + count) % self.num_blocks
        for block in blocks:
            previous = self.owner.get(block)
            if previous is not None and previous != mm_hash:
                self.items.pop(previous, None)  # its block is another item's now
            self.owner[block] = mm_hash
        self.items[mm_hash] = blocks
        return blocks


class ProducerRegion:
    """The VE worker's NIXL-registered region and the side channel that describes it."""

    def __init__(self, config: NixlECConfig) -> None:
        self.config = config
        set_ucx_device(config.ucx_address)
        self.agent = nixl_agent(f"{config.engine_id}-ve-{os.getpid()}", config.backends)
        self.region: torch.Tensor | None = None
        self.row_bytes = 0
        self.items: dict[str, SavedItem] = {}
        self.block_item: dict[int, tuple[str, int]] = {}  # block -> (item, generation)
        self.generation = 0
        self.lock = threading.Lock()
        # the reads open now, (item, generation) -> their deadlines: each PD's item request opens
        # one, its check (or transfer_timeout_sec) closes it. One window for all reads closed
        # on the first check left the others without this side's UCX progress until their PD
        # gave up (a generation error under load, issue 54's three-host run)
        self.windows: dict[tuple[str, int], list[float]] = {}
        self.served = {"items": 0, "bytes": 0, "refused": 0}
        self.stop = threading.Event()
        context = zmq.Context.instance()
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://{config.side_channel_host}:{config.side_channel_port}")
        self.thread = threading.Thread(target=self.serve, name="epd-nixl-ec-side-channel", daemon=True)
        self.thread.start()
        log.info(
            "EPD NIXL EC producer %s: side channel tcp://%s:%s (thread %#x, tid %s), region %d blocks x %d rows",
            config.engine_id,
            config.side_channel_host,
            config.side_channel_port,
            self.thread.ident,  # the thread's name in a faulthandler dump (nixl_agent.py: SIGUSR2)
            self.thread.native_id,
            config.num_blocks,
            config.block_tokens,
        )

    @property
    def block_len(self) -> int:
        return self.config.block_tokens * self.row_bytes

    def _ensure_region(self, row_bytes: int) -> None:
        if self.region is not None:
            if row_bytes != self.row_bytes:
                raise ValueError(f"an encoder output of {row_bytes} bytes a row in a region of {self.row_bytes}")
            return
        size = self.config.num_blocks * self.config.block_tokens * row_bytes
        if size > self.config.max_region_bytes:
            raise ValueError(
                f"{CONNECTOR_NAME}: {self.config.num_blocks} blocks x {self.config.block_tokens} rows x {row_bytes} "
                f"bytes = {size} bytes exceeds ec_max_region_bytes {self.config.max_region_bytes}"
            )
        region = torch.zeros(size, dtype=torch.uint8)
        self.agent.register_memory(region)
        self.region, self.row_bytes = region, row_bytes

    def save(self, mm_hash: str, tensor: torch.Tensor, blocks: list[int]) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        rows = tensor.shape[0]
        raw = tensor.view(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        row_bytes = raw.numel() // max(rows, 1)
        with self.lock:
            self._ensure_region(row_bytes)
            assert self.region is not None
            needed = -(-rows // self.config.block_tokens)
            if needed != len(blocks):
                raise ValueError(f"item {mm_hash}: {rows} rows need {needed} blocks, the scheduler gave {blocks}")
            for block in blocks:  # whatever item held these blocks is gone
                old = self.block_item.pop(block, None)
                if old is not None:
                    self.items.pop(old[0], None)
            self.generation += 1
            for index, block in enumerate(blocks):
                part = raw[index * self.block_len : (index + 1) * self.block_len]
                start = block * self.block_len
                self.region[start : start + part.numel()].copy_(part)
                self.block_item[block] = (mm_hash, self.generation)
            self.items[mm_hash] = SavedItem(
                blocks, rows, tuple(tensor.shape[1:]), str(tensor.dtype).removeprefix("torch."), self.generation
            )

    def describe(self, mm_hash: str, blocks: list[int]) -> dict[str, Any]:
        """The item's blocks as NIXL descriptors, only if they still hold it."""
        with self.lock:
            item = self.items.get(mm_hash)
            if item is None:
                return {"error": f"VE {self.config.engine_id} holds no encoder output for item {mm_hash}"}
            if item.blocks != list(blocks):
                where = f"blocks {item.blocks} of VE {self.config.engine_id}"
                return {"error": f"item {mm_hash} is in {where}, not {blocks}"}
            assert self.region is not None
            total = item.rows * self.row_bytes
            base = self.region.data_ptr()
            descs = []
            for index, block in enumerate(item.blocks):
                length = min(self.block_len, total - index * self.block_len)
                descs.append([base + block * self.block_len, length, 0])
            deadline = time.monotonic() + self.config.transfer_timeout_s
            self.windows.setdefault((mm_hash, item.generation), []).append(deadline)
            self.served["items"] += 1
            self.served["bytes"] += total
            return {
                "agent": self.agent.name,
                "descs": descs,
                "rows": item.rows,
                "row_shape": list(item.row_shape),
                "dtype": item.dtype,
                "generation": item.generation,
            }

    def check(self, mm_hash: str, generation: int) -> dict[str, Any]:
        with self.lock:
            item = self.items.get(mm_hash)
            ok = item is not None and item.generation == generation
            if not ok:
                self.served["refused"] += 1
            open_reads = self.windows.get((mm_hash, generation))
            if open_reads:
                open_reads.pop(0)
                if not open_reads:
                    del self.windows[(mm_hash, generation)]
            return {"ok": ok}

    def reading(self) -> bool:
        """Whether a PD's read may be in flight (a window open, not past its deadline)."""
        now = time.monotonic()
        with self.lock:
            for key in [k for k, deadlines in self.windows.items() if max(deadlines) <= now]:
                del self.windows[key]
            return bool(self.windows)

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "meta":
            metadata = self.agent.get_agent_metadata()
            return {"engine_id": self.config.engine_id, "agent": self.agent.name, "metadata": metadata}
        if op == "item":
            return self.describe(str(request["mm_hash"]), [int(b) for b in request["blocks"]])
        if op == "check":
            return self.check(str(request["mm_hash"]), int(request["generation"]))
        if op == "stats":
            return dict(self.served)
        return {"error": f"unknown side-channel request {op!r}"}

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self.stop.is_set():
            reading = self.reading()
            if reading:  # a PD's read is open: UCX over TCP needs this side's progress
                started = time.monotonic()
                try:
                    self.agent.get_new_notifs()
                except Exception as exc:  # NIXL's error must not end the side channel (and the VE's reads)
                    log.warning("EPD NIXL EC producer: UCX progress: %s", exc)
                slow(started, "UCX progress (get_new_notifs)")
            events = dict(poller.poll(WINDOW_POLL_MS if reading else IDLE_POLL_MS))
            if self.socket not in events:
                continue
            started, request = time.monotonic(), None
            try:
                request = msgpack.unpackb(self.socket.recv(), raw=False)
                reply = self.answer(request) if isinstance(request, dict) else {"error": "not a map"}
            except Exception as exc:  # a bad request must not end the side channel
                reply = {"error": f"{exc.__class__.__name__}: {exc}"}
            slow(started, f"side-channel request {request.get('op') if isinstance(request, dict) else '?'}")
            self.socket.send(msgpack.packb(reply, use_bin_type=True))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(IDLE_POLL_MS / 1000 * 2)
        self.socket.close(0)


# ---------------------------------------------------------------------------------------------
# PD


@dataclass
class Remote:
    """A VE the PD has handshaken with: its NIXL agent, registered with the PD's."""

    engine_id: str
    endpoint: str
    agent: str


@dataclass
class Read:
    """One item's hand-off, a step at a time: `handshake` (the VE's agent metadata, once per VE
    incarnation), `item` (its blocks' descriptors), `transfer` (the NIXL READ), `check` (the
    blocks still hold it). A side-channel round trip runs on the reader's threads (`pending`);
    the scheduler only looks whether it is done."""

    mm_hash: str
    engine_id: str
    endpoint: str
    blocks: list[int]
    rows: int
    asked: float  # when the PD started the hand-off
    phase: str = "handshake"
    pending: Future[dict[str, Any]] | None = None
    remote: Remote | None = None
    reply: dict[str, Any] = field(default_factory=dict)
    renewed: bool = False  # the VE answered for another agent once: handshaken again
    buffer: torch.Tensor | None = None
    registered: Any = None
    handle: Any = None
    started: float = 0.0
    deadline: float = 0.0


class ConsumerReader:
    """The PD scheduler's side: handshakes, reads and their checks.

    The scheduler's thread never waits on a VE: each side-channel round trip (bounded by
    `side_channel_timeout_sec`) runs on one of ASK_THREADS threads and `poll` only looks whether
    it answered, so a VE that died or hangs delays its own requests, not the PD's generation
    (issue 54: round trips of up to 5 s inside `ensure_cache_available` stopped a PD's
    scheduler when its VE was SIGKILLed, and the router ejected the PD). Every NIXL call stays on
    the scheduler's thread, the agent's one user on the PD."""

    def __init__(self, config: NixlECConfig) -> None:
        self.config = config
        set_ucx_device(config.ucx_address)
        self.agent = nixl_agent(f"{config.engine_id}-pd-{os.getpid()}", config.backends)
        self.remotes: dict[str, Remote] = {}
        self.handshakes: dict[str, Future[dict[str, Any]]] = {}  # engine_id -> its meta round trip
        self.context = zmq.Context.instance()
        self.asks = ThreadPoolExecutor(max_workers=ASK_THREADS, thread_name_prefix="epd-nixl-ec-ask")
        self.stats = {"items": 0, "bytes": 0, "failures": 0, "handshakes": 0}
        self.unreleased: list[Read] = []  # reads whose handle NIXL would not release (buffers kept)

    def ask(self, endpoint: str, request: dict[str, Any]) -> dict[str, Any]:
        """One side-channel round trip, bounded by side_channel_timeout_sec (a new socket each
        time: a REQ socket that timed out cannot be used again). Runs on the reader's threads."""
        socket = self.context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        timeout_ms = int(self.config.side_channel_timeout_s * 1000)
        socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
        socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        try:
            socket.connect(endpoint)
            socket.send(msgpack.packb(request, use_bin_type=True))
            reply = msgpack.unpackb(socket.recv(), raw=False)
        except zmq.Again:
            silent = f"the side channel {endpoint} did not answer within {timeout_ms} ms"
            raise ECLoadFailure(silent, lost=True) from None
        finally:
            socket.close(0)
        if not isinstance(reply, dict):
            raise ECLoadFailure(f"the side channel {endpoint} answered {reply!r}")
        if "error" in reply:
            raise ECLoadFailure(str(reply["error"]))
        return reply

    def submit(self, endpoint: str, request: dict[str, Any]) -> Future[dict[str, Any]]:
        return self.asks.submit(self.ask, endpoint, request)

    def start(self, mm_hash: str, locator: Any) -> Read:
        """A read of the item the locator names; nothing waits here (`poll` moves it on)."""
        if not isinstance(locator, dict) or not {"engine_id", "host", "port", "remote_block_ids", "num_tokens"} <= set(
            locator
        ):
            raise ECLoadFailure(f"no valid ec_locator for the item (got {locator!r})")
        engine_id, endpoint = str(locator["engine_id"]), f"tcp://{locator['host']}:{int(locator['port'])}"
        blocks = [int(b) for b in locator["remote_block_ids"]]
        return Read(mm_hash, engine_id, endpoint, blocks, int(locator["num_tokens"]), time.monotonic())

    def poll(self, read: Read) -> LoadedItem | None:
        """The read's bytes once done and checked; None while it waits (on the VE's answer or the
        transfer); ECLoadFailure else."""
        try:
            return self._step(read)
        except Exception as exc:
            failure = exc if isinstance(exc, ECLoadFailure) else None
            if failure is None:  # NIXL's own errors (its status exceptions), a malformed answer
                failure = ECLoadFailure(f"{exc.__class__.__name__}: {exc}", lost=True)
            if failure.lost and read.remote is not None:
                self.forget(read.remote)  # it may have died or restarted: handshake again next time
            self.release(read)
            if failure is exc:
                raise
            raise failure from exc

    def _step(self, read: Read) -> LoadedItem | None:
        while True:
            if read.phase == "handshake":
                known = self.remotes.get(read.engine_id)
                if known is not None and known.endpoint == read.endpoint:
                    read.remote = known
                else:
                    if read.pending is None:
                        read.pending = self.handshakes.get(read.engine_id)
                        if read.pending is None:  # one meta round trip per VE, shared by its reads
                            read.pending = self.handshakes[read.engine_id] = self.submit(read.endpoint, {"op": "meta"})
                    if not read.pending.done():
                        return None
                    done, read.pending = read.pending, None
                    if self.handshakes.get(read.engine_id) is done:
                        del self.handshakes[read.engine_id]
                    read.remote = self.register(read.engine_id, read.endpoint, done.result())
                read.phase = "item"
                item = {"op": "item", "mm_hash": read.mm_hash, "blocks": read.blocks}
                read.pending = self.submit(read.endpoint, item)
            elif read.phase == "item":
                assert read.pending is not None and read.remote is not None
                if not read.pending.done():
                    return None
                reply, read.pending = read.pending.result(), None
                if self.remotes.get(read.engine_id) is not read.remote:  # another read dropped it meanwhile
                    read.remote, read.phase = None, "handshake"  # (NIXL: no such agent, nixlNotFoundError)
                    continue
                if reply["agent"] != read.remote.agent:  # the VE restarted under the same engine id
                    if read.renewed:
                        raise ECLoadFailure(
                            f"VE {read.engine_id} answers for agent {reply['agent']}, its handshake said "
                            f"{read.remote.agent}",
                            lost=True,
                        )
                    self.forget(read.remote)
                    read.renewed, read.remote, read.phase = True, None, "handshake"
                    continue
                if int(reply["rows"]) != read.rows:
                    raise ECLoadFailure(f"the locator says {read.rows} rows, VE {read.engine_id} holds {reply['rows']}")
                read.reply = reply
                self.transfer(read)
                read.phase = "transfer"
            elif read.phase == "transfer":
                state = self.agent.check_xfer_state(read.handle)
                if state == "PROC" and time.monotonic() < read.deadline:
                    return None
                if state != "DONE":
                    why = "failed" if state == "ERR" else f"timed out after {self.config.transfer_timeout_s} s"
                    raise ECLoadFailure(f"the NIXL read from {read.engine_id} {why}", lost=True)
                check = {"op": "check", "mm_hash": read.mm_hash, "generation": read.reply["generation"]}
                read.pending = self.submit(read.endpoint, check)
                read.phase = "check"
            else:  # check
                assert read.pending is not None
                if not read.pending.done():
                    return None
                if not read.pending.result().get("ok"):
                    raise ECLoadFailure(f"VE {read.engine_id} reused the item's blocks during the read (stale)")
                return self.finish(read)

    def register(self, engine_id: str, endpoint: str, meta: dict[str, Any]) -> Remote:
        """The VE's agent, from its metadata: added to the PD's agent (the one it replaces removed
        first), or the one already added when another read of the same handshake did it."""
        if meta.get("engine_id") != engine_id:
            raise ECLoadFailure(f"the side channel {endpoint} is engine {meta.get('engine_id')!r}, not {engine_id!r}")
        known = self.remotes.get(engine_id)
        if known is not None and known.endpoint == endpoint and known.agent == meta.get("agent"):
            return known
        if known is not None:
            self.forget(known)
        name = self.agent.add_remote_agent(meta["metadata"])
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.remotes[engine_id] = made = Remote(engine_id, endpoint, name)
        self.stats["handshakes"] += 1
        log.info("EPD NIXL EC: handshake with %s at %s (agent %s)", engine_id, endpoint, name)
        return made

    def forget(self, remote: Remote) -> None:
        """A VE whose agent is gone (it died or restarted): its agent removed from the PD's, which
        drops the PD's connection to it (nixl `_api.py` remove_remote_agent -> invalidateRemoteMD
        -> the UCX backend's disconnect), and handshaken with again next time."""
        if self.remotes.get(remote.engine_id) is remote:
            del self.remotes[remote.engine_id]
            try:
                self.agent.remove_remote_agent(remote.agent)
            except Exception as exc:  # nixl raises its own status errors
                log.warning("EPD NIXL EC: removing agent %s: %s", remote.agent, exc)

    def transfer(self, read: Read) -> None:
        """Post the NIXL READ of the item's blocks into a buffer of this process."""
        assert read.remote is not None
        descs = read.reply["descs"]
        total = sum(int(d[1]) for d in descs)
        read.buffer = torch.empty(total, dtype=torch.uint8)
        read.registered = self.agent.register_memory(read.buffer)
        local, offset = [], 0
        for _addr, length, _dev in descs:
            local.append((read.buffer.data_ptr() + offset, int(length), 0))
            offset += int(length)
        read.handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs([tuple(int(v) for v in d) for d in descs], "DRAM"),
            read.remote.agent,
        )
        read.started = time.monotonic()
        read.deadline = read.started + self.config.transfer_timeout_s
        if self.agent.transfer(read.handle) == "ERR":
            raise ECLoadFailure(f"NIXL could not post the read from {read.engine_id}", lost=True)

    def finish(self, read: Read) -> LoadedItem:
        assert read.buffer is not None
        now = time.monotonic()
        elapsed_ms, hand_off_ms = (now - read.started) * 1000, (now - read.asked) * 1000
        data = read.buffer.numpy().tobytes()
        self.release(read)
        self.stats["items"] += 1
        self.stats["bytes"] += len(data)
        log.info(
            "EPD NIXL EC: read item %s (%d bytes, %d blocks) from %s over NIXL in %.2f ms (hand-off %.2f ms)",
            read.mm_hash,
            len(data),
            len(read.reply["descs"]),
            read.engine_id,
            elapsed_ms,
            hand_off_ms,
        )
        shape = (int(read.reply["rows"]), *(int(v) for v in read.reply["row_shape"]))
        return LoadedItem(data, str(read.reply["dtype"]), shape)

    def release(self, read: Read) -> None:
        """The read's NIXL handle and buffer, once (a round trip still running is left to end)."""
        handle, registered = read.handle, read.registered
        read.handle = read.registered = None
        if handle is not None:
            try:  # in flight: NIXL cancels its UCX requests first (nixl_agent.cpp releaseXferReq)
                self.agent.release_xfer_handle(handle)
            except Exception as exc:  # refused: UCX may still write into the buffer, so it stays
                log.warning("EPD NIXL EC: releasing the read of %s: %s", read.mm_hash, exc)
                self.unreleased.append(read)
                return
        if registered is not None:
            self.agent.deregister_memory(registered)

    def close(self) -> None:
        self.asks.shutdown(wait=False, cancel_futures=True)


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (vllm/distributed/parallel_state.py
    get_tensor_model_parallel_rank, 0.24.0 and 0.29.0), 0 before the groups exist."""
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_tensor_model_parallel_rank()
    except AssertionError:  # "tensor model parallel group is not initialized"
        return 0


# ---------------------------------------------------------------------------------------------
# the connector


class EPDNixlECConnector(ECConnectorBase):
    """See the module's docstring. One instance per role: SCHEDULER (the engine core) and WORKER."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        # the vLLM internals it relies on beyond ECConnectorBase's abstract methods: compat.py
        require(CONNECTOR_NAME, CONNECTOR_INTERNALS)
        super().__init__(vllm_config=vllm_config, role=role)
        self.config = NixlECConfig.from_vllm(vllm_config)
        # scheduler side
        self._ring = BlockRing(self.config.num_blocks)
        self._saves: dict[str, list[int]] = {}
        self._reader: ConsumerReader | None = None
        self._reads: dict[str, Read] = {}
        self._ready: dict[str, LoadedItem] = {}
        self._loads: dict[str, LoadedItem] = {}
        self._failures: dict[str, str] = {}
        # worker side
        self._region: ProducerRegion | None = None
        self._pending_saves: dict[str, list[int]] = {}
        if role == ECConnectorRole.WORKER and self.is_producer and tensor_parallel_rank() == 0:
            # rank 0 serves the base port, the one the locator names (docs/contract.md §2.4); the
            # other ranks' encoder outputs are the same
            self._region = ProducerRegion(self.config)
        if role == ECConnectorRole.SCHEDULER and self.is_consumer:
            self._reader = ConsumerReader(self.config)

    # ---- scheduler side ----------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        # a producer encodes every item; a consumer loads only what it has read
        return self.is_consumer and identifier in self._ready

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Start or finish the reads of the request's items; False defers the request (the
        scheduler asks again next step), a failure is kept for take_load_failures."""
        if self._reader is None:  # a producer encodes
            return True
        if request.request_id in self._failures:  # ended at the next update_from_output
            return False
        params = request.kv_transfer_params or {}
        locators = params.get("ec_locator") if isinstance(params, dict) else None
        waiting, failed = False, []
        for feature in request.mm_features:
            mm_hash = feature.identifier
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens or mm_hash in self._ready:
                continue  # its KV is cached already, or its bytes are here
            try:
                read = self._reads.get(mm_hash)
                if read is None:
                    locator = (locators or {}).get(mm_hash)
                    if locator is None:
                        raise ECLoadFailure("the request carries no ec_locator for it")
                    read = self._reads[mm_hash] = self._reader.start(mm_hash, locator)
                loaded = self._reader.poll(read)
            except ECLoadFailure as exc:
                self._reads.pop(mm_hash, None)
                failed.append((mm_hash, str(exc)))
                continue
            except Exception as exc:  # NIXL's own errors: the request fails, the engine lives
                self._reads.pop(mm_hash, None)
                failed.append((mm_hash, f"{exc.__class__.__name__}: {exc}"))
                continue
            if loaded is None:
                waiting = True
            else:
                del self._reads[mm_hash]
                self._ready[mm_hash] = loaded
        if failed:
            assert self._reader is not None
            self._reader.stats["failures"] += 1
            message = LOAD_FAILURE.format(hashes=[h for h, _ in failed], reason="; ".join(r for _, r in failed))
            log.error("EPD NIXL EC: request %s: %s", request.request_id, message)
            self._failures[request.request_id] = message
            return False
        return not waiting

    def take_load_failures(self) -> dict[str, str]:
        """Requests whose reads failed, with ECLoadFailure's message (ECLocatorScheduler ends them)."""
        failures, self._failures = self._failures, {}
        return failures

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if self.is_producer:
            rows = request.get_num_encoder_embeds(index)
            count = max(1, -(-rows // self.config.block_tokens))
            try:
                self._saves[mm_hash] = self._ring.allocate(mm_hash, count)
            except ValueError as exc:  # an item larger than the region: its locator names no block
                log.error("EPD NIXL EC: item %s (%d rows) not kept: %s", mm_hash, rows, exc)
        elif mm_hash in self._ready:
            self._loads[mm_hash] = self._ready.pop(mm_hash)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = NixlECMetadata(saves=self._saves, loads=self._loads)
        self._saves, self._loads = {}, {}
        return meta

    def item_blocks(self, mm_hash: str) -> list[int]:
        """The producer's blocks of an item, for its locator ([] once the ring reused them)."""
        return list(self._ring.items.get(mm_hash, []))

    # ---- worker side -------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, NixlECMetadata):
            self._pending_saves.update(connector_metadata.saves)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if self._region is None:
            return
        blocks = self._pending_saves.pop(mm_hash, None)
        if blocks is None:
            log.warning("EPD NIXL EC: no blocks for item %s: not saved (a PD asking for it fails)", mm_hash)
            return
        try:
            self._region.save(mm_hash, encoder_cache[mm_hash], blocks)
        except ValueError as exc:  # the PD's read of this item fails; the VE serves on
            log.error("EPD NIXL EC: item %s not saved: %s", mm_hash, exc)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, NixlECMetadata)
        for mm_hash, item in metadata.loads.items():
            if mm_hash in encoder_cache:
                continue
            dtype = getattr(torch, item.dtype)
            encoder_cache[mm_hash] = torch.frombuffer(bytearray(item.data), dtype=dtype).view(item.shape)

    def shutdown(self) -> None:
        if self._region is not None:
            self._region.close()
        if self._reader is not None:
            self._reader.close()
