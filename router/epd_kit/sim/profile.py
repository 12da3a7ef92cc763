"""Latency profile of the simulated engine (defaults and rationale: docs/sim.md).

Defaults model Qwen3-VL-32B on trn2 (VE: one vision replica per NeuronCore, PD: TP=8 = one
trn2 chip). Every number is overridable per engine (--sim-* flags / EPD_SIM_* env).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LatencyProfile:
    compile_s: float = 2.0  # a compile cache miss: compiling the engine's graphs (docs/sim.md "Compile cache")
    fetch_s: float = 0.3  # a local miss that the remote tier (NEURON_LIBTORCH_REMOTE_CACHE) answers
    warmup_s: float = 0.2  # warmup after compile (where a misaligned slice fails)
    encode_ms_per_1k_patches: float = 40.0  # per vision DP replica
    encode_overhead_ms: float = 3.0  # per VE request (scheduling + device drain)
    prefill_ms_per_1k_tokens: float = 250.0
    decode_ms_per_token: float = 30.0  # one decode step of a single sequence
    decode_ms_per_extra_seq: float = 0.3  # step cost growth with batch size
    transfer_gb_per_s: float = 12.0  # EFA RDMA READ of an encoder-cache block

    def encode_s(self, replica_patches: list[int]) -> float:
        """Items are spread over DP replicas; the request waits for the busiest one."""
        busiest = max(replica_patches, default=0)
        return (self.encode_overhead_ms + self.encode_ms_per_1k_patches * busiest / 1024) / 1e3

    def step_s(self, prefill_tokens: int, decoding: int) -> float:
        ms = self.prefill_ms_per_1k_tokens * prefill_tokens / 1000
        if decoding:
            ms += self.decode_ms_per_token + self.decode_ms_per_extra_seq * (decoding - 1)
        return ms / 1e3

    def transfer_s(self, nbytes: int) -> float:
        if self.transfer_gb_per_s <= 0:
            return 0.0
        return nbytes / (self.transfer_gb_per_s * 1e9)


PROFILES: dict[str, LatencyProfile] = {
    "trn2-32b": LatencyProfile(),
    # For tests: no simulated time at all (the engine still runs every code path).
    "zero": LatencyProfile(
        compile_s=0.0,
        fetch_s=0.0,
        warmup_s=0.0,
        encode_ms_per_1k_patches=0.0,
        encode_overhead_ms=0.0,
        prefill_ms_per_1k_tokens=0.0,
        decode_ms_per_token=0.0,
        decode_ms_per_extra_seq=0.0,
        transfer_gb_per_s=0.0,
    ),
}


def build_profile(name: str, **overrides: float | None) -> LatencyProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown latency profile {name!r}; choose one of {sorted(PROFILES)}")
    return replace(PROFILES[name], **{k: v for k, v in overrides.items() if v is not None})
