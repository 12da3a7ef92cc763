"""Start simulated engines the way the kit starts real ones (tests, demo, benchmarks).

Every argv and environment here comes from the kit's one engine command model
(epd_kit.plan): `serve_argv` is the kit's `serve` command for one local engine on any port,
with `epd-sim` as the executable; `ve_argv` / `pd_argv` are the tutorial's Step 1 / Step 2 with
keyword knobs, including the deliberate departures the failure tests need; `engine_env` is the
environment the kit sets (docs/contract.md §6.4). `SimProcess` runs one engine as a subprocess
(the plumbing is epd_kit.testing.process) and always cleans up. Only 127.0.0.1-style local
use: nothing here picks hosts.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from epd_kit import plan
from epd_kit.testing.process import ManagedProcess, free_port

__all__ = [
    "SimProcess",
    "engine_command",
    "engine_env",
    "free_port",
    "local_settings",
    "pd_argv",
    "serve_argv",
    "ve_argv",
]

DEFAULT_SIM = Path(sys.executable).parent / "epd-sim"
# the sim's stand-in neuronx-cc (roles/epd_engines installs the same file for sim-backend hosts)
STANDIN_BIN = Path(__file__).resolve().parent / "standin_bin"
HOST = "127.0.0.1"
# The simulator always loads a local checkpoint directory: the kit then sets HF_HUB_OFFLINE=1.
_LOCAL_SETTINGS = plan.read_settings({"epd_model": "/checkpoint", "epd_engine_backend": "sim"})


def local_settings(
    role: str,
    model: str,
    *,
    tp: int | None = None,
    dp: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    images: int | None = None,
    blocks: int | None = None,
    **variables: object,
) -> plan.Settings:
    """The fleet settings of one local engine; a knob left unset keeps the planner's default,
    `variables` are further inventory variables (default backend: sim)."""
    knobs = {
        f"epd_{role}_tp": tp,
        "epd_ve_dp": dp,
        "epd_max_model_len": max_model_len,
        "epd_max_num_seqs": max_num_seqs,
        "epd_images_per_prompt": images,
        "epd_encoder_cache_num_blocks": blocks,
    }
    return plan.read_settings(
        {
            "epd_model": model,
            "epd_engine_backend": "sim",
            **variables,
            **{name: value for name, value in knobs.items() if value is not None},
        }
    )


def engine_command(
    role: str,
    model: str,
    port: int,
    *,
    side_channel_port: int | None = None,
    host: str = HOST,
    engine_id: str | None = None,
    **knobs: object,
) -> plan.EngineCommand:
    """The kit's command for one local engine (`knobs`: see `local_settings`)."""
    settings = local_settings(role, model, **knobs)  # type: ignore[arg-type]
    engine_id = engine_id or f"{settings.engine_id_prefix}-{role}-0"
    return plan.engine_command(settings, role, engine_id, host, port, side_channel_port)


def serve_argv(role: str, model: str, port: int, *, executable: str = str(DEFAULT_SIM), **knobs: object) -> list[str]:
    """The kit's `serve` argv for one local engine (`knobs`: see `engine_command`)."""
    return engine_command(role, model, port, **knobs).argv(executable)  # type: ignore[arg-type]


def _departing(
    command: plan.EngineCommand,
    executable: str,
    *,
    model: str | None,
    max_num_batched_tokens: int | None,
    vab: int | None,
    vision: Mapping[str, object],
    ec_extra: Mapping[str, object] | None,
    extra_flags: Sequence[str],
) -> list[str]:
    """The argv of `command` with the departures from the kit's command a failure test asks for."""
    if model is not None:
        command = command.replace(EPD_MODEL=model)
    if max_num_batched_tokens is not None:
        command = command.replace(EPD_MAX_NUM_BATCHED_TOKENS=str(max_num_batched_tokens))
    vision = dict(vision)
    if vab is not None:  # a block size the image geometry cannot give (e.g. one pool disagreeing)
        images = json.loads(str(command.values["EPD_LIMIT_MM_PER_PROMPT"]))["image"]
        vision.update(num_vision_tokens_buckets=[images * vab], vision_attention_block_size=vab)
    if vision:
        command = command.merge_json("EPD_ADDITIONAL_CONFIG", {"vision_neuron_config": vision})
    if ec_extra:
        command = command.merge_json("EPD_EC_TRANSFER_CONFIG", {"ec_connector_extra_config": dict(ec_extra)})
    argv = command.argv(executable)
    if model is None:  # no model at all: `serve` falls back to its text-only default
        del argv[2]
    if tuple(extra_flags) != (plan.PREFIX_CACHING_OFF,):
        at = argv.index(plan.PREFIX_CACHING_OFF)
        argv[at : at + 1] = list(extra_flags)
    return argv


def ve_argv(
    model: str | None,
    port: int,
    side_channel_port: int,
    *,
    host: str = HOST,
    tp: int | None = None,
    engine_id: str = "epd-ve-0",
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    images: int | None = None,
    extra_flags: Sequence[str] = (plan.PREFIX_CACHING_OFF,),
    executable: str = str(DEFAULT_SIM),
    vab: int | None = None,
    blocks: int | None = None,
    dp: int | None = None,
    **vision: object,
) -> list[str]:
    """Tutorial Step 1; `vision` adds vision_neuron_config keys. A model of "" or None, another
    max_num_batched_tokens, vab or extra_flags depart from the kit's command on purpose."""
    command = engine_command(
        "ve",
        model or "/checkpoint",
        port,
        side_channel_port=side_channel_port,
        host=host,
        engine_id=engine_id,
        tp=tp,
        dp=dp,
        max_model_len=max_model_len,
        images=images,
        blocks=blocks,
    )
    return _departing(
        command,
        executable,
        model=model,
        max_num_batched_tokens=max_num_batched_tokens,
        vab=vab,
        vision=vision,
        ec_extra=None,
        extra_flags=extra_flags,
    )


def pd_argv(
    model: str | None,
    port: int,
    *,
    host: str = HOST,
    tp: int | None = None,
    engine_id: str = "epd-pd-0",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    images: int | None = None,
    extra_flags: Sequence[str] = (plan.PREFIX_CACHING_OFF,),
    ec_extra: Mapping[str, object] | None = None,
    executable: str = str(DEFAULT_SIM),
    vab: int | None = None,
    blocks: int | None = None,
    **vision: object,
) -> list[str]:
    """Tutorial Step 2. `ec_extra` adds ec_connector_extra_config keys (transfer_timeout_sec)."""
    command = engine_command(
        "pd",
        model or "/checkpoint",
        port,
        host=host,
        engine_id=engine_id,
        tp=tp,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        images=images,
        blocks=blocks,
    )
    return _departing(
        command,
        executable,
        model=model,
        max_num_batched_tokens=None,
        vab=vab,
        vision=vision,
        ec_extra=ec_extra,
        extra_flags=extra_flags,
    )


def engine_env(cores: str, *, efa: bool = True, base: Mapping[str, str] | None = None, **sim: str) -> dict[str, str]:
    """The kit's engine environment (docs/contract.md §6.4) + EPD_SIM_* settings (`profile="zero"`...),
    with the sim's stand-in neuronx-cc first on PATH.
    `efa=False` leaves the EFA settings out (a failure test). Inherited EPD_SIM_*, FI_EFA_* and
    NEURON_* variables are dropped so a test is explicit."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith(("EPD_SIM_", "FI_EFA_", "NEURON_"))
    }
    env.update(plan.engine_env(_LOCAL_SETTINGS, [int(core) for core in cores.split(",")]))
    # the sim's stand-in compiler first on PATH, as the kit's sim units have it (a cache miss needs one)
    env["PATH"] = os.pathsep.join([str(STANDIN_BIN), env.get("PATH", os.defpath)])
    if not efa:
        for name in plan.EFA_ENVIRONMENT:
            del env[name]
    env.update({f"EPD_SIM_{k.upper()}": str(v) for k, v in sim.items()})
    return env


class SimProcess(ManagedProcess):
    """One engine subprocess (epd_kit.testing.process); stdout+stderr go to `log_path`.
    Use `stop()` in a finalizer."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.host = argv[argv.index("--host") + 1] if "--host" in argv else "0.0.0.0"
        self.port = int(argv[argv.index("--port") + 1])
        self.url = f"http://{'127.0.0.1' if self.host == '0.0.0.0' else self.host}:{self.port}"
        super().__init__(argv, log_path, env=env, name="engine")

    def wait_ready(self, timeout: float = 30.0) -> SimProcess:
        """Poll /health until 200 (the units' readiness gate); fail fast if the process exits."""
        self.wait_http(self.url + "/health", timeout)
        return self
