"""The one stand-in of the compat tier: vLLM's engine core (the scheduler + model process).

Everything in front of it is vLLM's own code: the API server's argv parser, app and
`/inference/v1/generate` route, `mm_serde`, `AsyncLLM` with its input and output processors.
Where the real engine core receives an `EngineCoreRequest` over ZMQ, this one takes it in
process, sends it through the same msgpack codec, the multimodal receiver cache and
`Request.from_engine_core_request` (what `EngineCore.preprocess_add_request` does), keeps the
`Request` for the test to inspect and answers like a VE or a PD of the tutorial:

- a VE (`--mm-encoder-only`) returns the one placeholder token `[0]` and an `ec_locator` per
  item in `kv_transfer_params` (docs/contract.md §2.4), as the Neuron EC connector does;
- a PD returns `OUTPUT_TOKENS`, cut to `max_tokens`, one token per engine step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.request import Request
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from tests.compat.vllm_api import engine_receiver_cache_from_config

OUTPUT_TOKENS = (40, 41, 42, 43, 44, 45, 46, 47)  # plain BPE ids of the tiny checkpoint
VE_PLACEHOLDER_TOKEN = 0


@dataclass
class EngineHealth:
    """What `AsyncLLM.errored` reads (`MPClient.resources.engine_dead`)."""

    engine_dead: bool = False


@dataclass
class StandInEngineCore(EngineCoreClient):
    """In-process `EngineCoreClient` for `AsyncLLM` (what `make_async_mp_client` returns)."""

    vllm_config: VllmConfig
    requests: list[Request] = field(default_factory=list)
    engine_ranks_managed: list[int] = field(default_factory=lambda: [0])
    resources: EngineHealth = field(default_factory=EngineHealth)

    def __post_init__(self) -> None:
        cache = self.vllm_config.cache_config
        self._block_hasher = None  # as EngineCore: hashes only with prefix caching on
        if cache.enable_prefix_caching:
            hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self._block_hasher = get_request_block_hasher(cache.block_size, hash_fn)
        self._receiver_cache = engine_receiver_cache_from_config(self.vllm_config)
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreRequest)
        self._outputs: asyncio.Queue[EngineCoreOutputs] = asyncio.Queue()

    @property
    def is_encoder(self) -> bool:
        return bool(self.vllm_config.model_config.multimodal_config.mm_encoder_only)

    def _locator_base(self) -> dict[str, Any]:
        """engine_id, host, port of this VE's locators: its `--ec-transfer-config` (§2.4)."""
        ec = self.vllm_config.ec_transfer_config
        extra = ec.ec_connector_extra_config
        return {"engine_id": ec.engine_id, "host": extra["side_channel_host"], "port": extra["side_channel_port"]}

    # --- the calls AsyncLLM makes on the request path ---

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        # the ZMQ hop: vLLM's codec both ways, as between the API server and the engine core
        received = self._decoder.decode(self._encoder.encode(request))
        if self._receiver_cache is not None and received.mm_features:
            received.mm_features = self._receiver_cache.get_and_update_features(received.mm_features)
        req = Request.from_engine_core_request(received, self._block_hasher)
        self.requests.append(req)
        for step in self._answer(req):
            self._outputs.put_nowait(EngineCoreOutputs(outputs=[step], timestamp=time.monotonic()))

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        pass  # every answer is queued whole at add time: nothing is left to stop

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def reset_mm_cache_async(self) -> None:
        if self._receiver_cache is not None:
            self._receiver_cache.clear_cache()

    async def reset_prefix_cache_async(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def shutdown(self, timeout: float | None = None) -> None:
        pass

    def dp_engines_running(self) -> bool:
        return False

    # --- what the engine "generates" ---

    def _answer(self, req: Request) -> list[EngineCoreOutput]:
        if self.is_encoder:
            return [
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[VE_PLACEHOLDER_TOKEN],
                    finish_reason=FinishReason.LENGTH,
                    kv_transfer_params={"ec_locator": self._locators(req)},
                )
            ]
        max_tokens = req.sampling_params.max_tokens or len(OUTPUT_TOKENS)
        tokens = OUTPUT_TOKENS[: min(max_tokens, len(OUTPUT_TOKENS))]
        steps = [EngineCoreOutput(request_id=req.request_id, new_token_ids=[t]) for t in tokens]
        steps[-1].finish_reason = FinishReason.LENGTH if len(tokens) == max_tokens else FinishReason.STOP
        return steps

    def _locators(self, req: Request) -> dict[str, dict[str, Any]]:
        base = self._locator_base()
        return {
            feature.identifier: {**base, "remote_block_ids": [block], "num_tokens": feature.mm_position.length}
            for block, feature in enumerate(req.mm_features)
        }
