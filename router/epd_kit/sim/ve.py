"""The vision-encoder role (ec_producer): docs/contract.md §2."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..wire import (
    EC_LOCATOR,
    EcHandoffItem,
    EcLocator,
    EcTransferItem,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    Placeholder,
    handoff_answer_fields,
    server_request_id,
)
from .config import EngineConfig
from .encoder_cache import EncoderCache
from .errors import RequestRejected, check_prompt_length
from .faults import Faults
from .metrics import SimMetrics
from .model import embedding_bytes
from .profile import LatencyProfile
from .release import AnswerShape
from .side_channel import SideChannelServer

if TYPE_CHECKING:
    from .tracing import RequestTrace

log = logging.getLogger("epd_sim.ve")


@dataclass(frozen=True)
class EncodeItem:
    mm_hash: str
    placeholder: Placeholder
    grid: tuple[int, int, int]

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


def parse_items(req: GenerateRequest, cfg: EngineConfig) -> list[EncodeItem]:
    """Validate the VE body far enough to know each item's geometry (docs/contract.md §2.2, §2.6)."""
    check_prompt_length(
        len(req.token_ids), cfg.max_model_len, max_tokens_given="max_tokens" in req.sampling_params.model_fields_set
    )
    items = req.features.items() if req.features else []
    if not items:
        raise RequestRejected("a VE request needs at least one multimodal item in features")
    # no --limit-mm-per-prompt check, as on a real VE (pd.build_sequence says why)
    geo = cfg.vision
    out = []
    if items:
        from .. import mm_serde  # numpy: loaded by the first image, not at start (epd_kit/asgi.py says why)

    for i, (_modality, mm_hash, ph, kwargs_b64) in enumerate(items):
        if ph.offset + ph.length > len(req.token_ids):
            raise RequestRejected(
                f"item {i}: placeholder [{ph.offset}, {ph.offset + ph.length}) lies outside "
                f"the {len(req.token_ids)} prompt tokens"
            )
        try:
            item = mm_serde.decode_item_b64(kwargs_b64)
            grid = mm_serde.grid_thw(item)
        except mm_serde.MMSerdeError as exc:
            raise RequestRejected(f"item {i} ({mm_hash}): bad kwargs_data: {exc}") from exc
        t, h, w = grid
        patches = t * h * w
        pixels = item.get("pixel_values")
        want = (patches, geo.patch_dim)
        if pixels is None or pixels.data is None or tuple(pixels.data.shape) != want:
            got = None if pixels is None or pixels.data is None else tuple(pixels.data.shape)
            raise RequestRejected(
                f"item {i} ({mm_hash}): pixel_values shape {got} does not match "
                f"image_grid_thw {list(grid)} (expected {want})"
            )
        tokens = patches // geo.merge_factor
        if patches % geo.merge_factor or tokens != ph.length:
            raise RequestRejected(
                f"item {i} ({mm_hash}): placeholder length {ph.length} does not match "
                f"image_grid_thw {list(grid)} ({patches} patches / merge "
                f"{geo.merge_factor} = {patches / geo.merge_factor:g} tokens)"
            )
        out.append(EncodeItem(mm_hash, ph, grid))
    return out


def _check_encodable(item: EncodeItem, cfg: EngineConfig) -> None:
    """The compiled vision encoder's limits (tutorial Common issues; docs/contract.md §2.6)."""
    max_embeds = cfg.max_vision_tokens // cfg.vision.merge_factor
    if item.placeholder.length > max_embeds:
        raise RequestRejected(
            f"Image item {item.mm_hash} produces {item.placeholder.length} embedding tokens, "
            f"which exceeds the maximum supported by the compiled vision encoder "
            f"({max_embeds} = max(num_vision_tokens_buckets) {cfg.max_vision_tokens} / merge "
            f"factor {cfg.vision.merge_factor})."
        )
    if item.patches > cfg.vision_attention_block_size:
        raise RequestRejected(
            f"Failed to encode image {item.mm_hash}: {item.patches} patches (image_grid_thw "
            f"{list(item.grid)}) exceed vision_attention_block_size="
            f"{cfg.vision_attention_block_size} of the compiled vision encoder. Downscale the "
            f"image or raise vision_attention_block_size identically on both pools."
        )


def _indices(mm_hash: str, items: list[EncodeItem]) -> list[int]:
    """Every index of `mm_hash` among the request's items (upstream's `item_indices`)."""
    return [i for i, other in enumerate(items) if other.mm_hash == mm_hash]


def spread_over_replicas(patches: list[int], replicas: int) -> list[int]:
    """Greedy longest-first assignment of items to vision DP replicas; load per replica."""
    load = [0] * max(1, replicas)
    for p in sorted(patches, reverse=True):
        load[load.index(min(load))] += p
    return load


class VisionEncoderEngine:
    def __init__(
        self, cfg: EngineConfig, profile: LatencyProfile, metrics: SimMetrics, faults: Faults, answers: AnswerShape
    ) -> None:
        self.cfg = cfg
        self.answers = answers
        self.profile = profile
        self.metrics = metrics
        self.cache = EncoderCache(cfg.encoder_cache_num_blocks, cfg.encoder_cache_min_hold_s)
        self.side_channel = SideChannelServer(
            engine_id=cfg.engine_id,
            block_len=cfg.block_len,
            cache=self.cache,
            efa_env_ok=cfg.efa_env_ok,
            faults=lambda: self.faults,
        )
        self.faults = faults
        self.side_channel_port = cfg.side_channel_port
        # The Neuron VE runs one scheduled batch at a time (--max-num-seqs 1).
        self._busy = asyncio.Lock()
        self._waiting = 0
        self.dead = False

    async def start(self) -> None:
        self.side_channel_port = await self.side_channel.start(self.cfg.side_channel_host, self.cfg.side_channel_port)
        log.info(
            "EC side channel for engine %s listening on %s:%d (block_len=%d bytes, %d blocks)",
            self.cfg.engine_id,
            self.cfg.side_channel_host,
            self.side_channel_port,
            self.cfg.block_len,
            self.cfg.encoder_cache_num_blocks,
        )

    async def stop(self) -> None:
        await self.side_channel.close()

    async def generate(self, req: GenerateRequest, trace: RequestTrace | None = None) -> GenerateResponse:
        items = parse_items(req, self.cfg)
        unique: dict[str, EncodeItem] = {}
        for it in items:
            unique.setdefault(it.mm_hash, it)
        if len(unique) > self.cache.capacity:
            raise RequestRejected(
                f"encoder_cache_num_blocks={self.cfg.encoder_cache_num_blocks} is too small: "
                f"this request has {len(unique)} images and the cache holds "
                f"{self.cache.capacity} (+1 scratch block)"
            )
        for it in unique.values():
            try:
                _check_encodable(it, self.cfg)
            except RequestRejected as exc:
                log.error("%s", exc.message)
                raise
        self._waiting += 1
        self.metrics.waiting.set(self._waiting)
        queued = time.monotonic()
        if trace is not None:
            trace.queue()
        try:
            async with self._busy:
                self.metrics.queue_time.observe(time.monotonic() - queued)
                if trace is not None:
                    trace.schedule()
                self._waiting -= 1
                self.metrics.waiting.set(self._waiting)
                self.metrics.running.set(1)
                blocks = await self._encode(list(unique.values()))
        finally:
            self.metrics.running.set(0 if not self._busy.locked() else 1)
        finish, tokens = self.answers.ve_finish
        self.metrics.prompt_tokens.inc(len(req.token_ids))
        self.metrics.generation_tokens.inc(len(tokens))
        self.metrics.finished(finish)
        if trace is not None:
            trace.output(len(tokens))
            trace.finish(finish)
        handoff = {h: self._handoff_item(h, it, blocks[h], items) for h, it in unique.items()}
        if self.faults.handoff_unannounced:
            handoff = {h: self._unannounced(h, items) for h in unique} if self.answers.handoff != EC_LOCATOR else {}
        return GenerateResponse(
            request_id=server_request_id(),
            choices=[GenerateChoice(index=0, finish_reason=finish, token_ids=list(tokens))],
            **handoff_answer_fields(self.answers.handoff, handoff),
        )

    @staticmethod
    def _unannounced(mm_hash: str, items: list[EncodeItem]) -> EcHandoffItem:
        """Fault `handoff_unannounced`: upstream's entry for an item its producer no longer holds."""
        return EcTransferItem(item_indices=_indices(mm_hash, items), metadata={})

    def _handoff_item(self, mm_hash: str, item: EncodeItem, block_id: int, items: list[EncodeItem]) -> EcHandoffItem:
        """Where the PD fetches `mm_hash`, in the hand-off of the vLLM the sim answers as."""
        if self.answers.handoff == EC_LOCATOR:
            return EcLocator(
                engine_id=self.cfg.engine_id,
                host=self.cfg.side_channel_host,
                port=self.side_channel_port,
                remote_block_ids=[block_id],
                num_tokens=item.placeholder.length,
            )
        # upstream's producer (vLLM 0.32.0 ec_connector/cpu/scheduler/__init__.py request_finished):
        # every index of the item in this request, the model's placeholder metadata (Qwen3-VL's
        # image_grid_thw, model_executor/models/qwen2_vl.py Qwen2VLMultiModalDataParser
        # embedding_fields, as utils.py collect_ec_item_metadata lists it), its side channel's
        # address, the bytes of its blocks and the tensor's shape (rows x the encoder's output
        # width); the PD fetches it by mm_hash
        return EcTransferItem(
            item_indices=_indices(mm_hash, items),
            metadata={"image_grid_thw": list(item.grid)},
            peer_host=self.cfg.side_channel_host,
            peer_port=self.side_channel_port,
            size_bytes=self.cfg.block_len,
            shape=[item.placeholder.length, self.cfg.vision.fat_dim],
        )

    async def _encode(self, items: list[EncodeItem]) -> dict[str, int]:
        blocks: dict[str, int] = {}
        misses: list[EncodeItem] = []
        for it in items:
            self.metrics.ec_queries.inc()
            block_id = self.cache.lookup(it.mm_hash)
            if block_id is None:
                misses.append(it)
            else:
                self.metrics.ec_hits.inc()
                blocks[it.mm_hash] = block_id
        keep = set(blocks.values())
        allocated: list[int] = []
        try:
            for it in misses:
                while (block_id := self.cache.allocate(it.mm_hash, keep)) is None:  # noqa: ASYNC110 (a hold time, not an event)
                    # Every evictable block is inside its minimum hold time: wait it out.
                    await asyncio.sleep(self.cache.wait_hint_s(keep) + 0.001)
                keep.add(block_id)
                allocated.append(block_id)
                blocks[it.mm_hash] = block_id
            if misses:
                load = spread_over_replicas([it.patches for it in misses], self.cfg.vision_dp)
                await asyncio.sleep(self.profile.encode_s(load))
        except BaseException:
            for block_id in allocated:
                self.cache.release_unwritten(block_id)
            raise
        for it in misses:
            self.cache.write(blocks[it.mm_hash], embedding_bytes(it.mm_hash))
        return blocks
