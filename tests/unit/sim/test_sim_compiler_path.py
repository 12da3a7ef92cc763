"""A real epd-sim process and neuronx-cc on its PATH (docs/sim.md "Compile cache"): a compile
cache miss needs the compiler and fails the start without it; a warm cache does not need it."""

from __future__ import annotations

import os
from pathlib import Path

from epd_kit.sim.launch import SimProcess, engine_env, free_port, pd_argv

NO_COMPILER_PATH = "/usr/bin:/bin"  # the engine's Python runs by absolute path; no neuronx-cc here


def env_for(cache_root: Path, path: str | None, **extra: str) -> dict[str, str]:
    env = engine_env("0,1,2,3,4,5,6,7", profile="zero", dead_linger_s="0.2", grace_s="2")
    env.update({"VLLM_CACHE_ROOT": str(cache_root), **extra})
    if path is not None:
        env["PATH"] = path
    return env


def test_a_cold_start_needs_neuronx_cc_on_path_and_a_warm_one_does_not(tiny_ckpt: Path, tmp_path: Path) -> None:
    assert not any((Path(d) / "neuronx-cc").exists() for d in NO_COMPILER_PATH.split(os.pathsep))
    root = tmp_path / "cache"
    cpu = {"VLLM_NEURON_CPU_COMPILE": "1", "NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}
    argv = pd_argv(str(tiny_ckpt), free_port())

    cold = SimProcess(argv, env_for(root, NO_COMPILER_PATH, **cpu), tmp_path / "cold.log")
    try:
        assert cold.wait_exit(30) == 1
    finally:
        cold.stop()
    log = cold.log()
    assert "RuntimeError: neuronx-cc not found on PATH: graph" in log and "of engine epd-pd-0" in log
    assert not list((root / "neuron/compile_cache").glob("?" * 32))

    # the launcher's environment, like a sim unit, has the stand-in compiler first on PATH
    built = SimProcess(argv, env_for(root, None, **cpu), tmp_path / "built.log")
    try:
        built.wait_ready(30)  # a CPU compile keeps serving /health until stopped (docs/sim.md)
    finally:
        assert built.stop() == 0
    assert "Compile cache miss: compiling graph" in built.log() and "standin_bin/neuronx-cc" in built.log()

    warm = SimProcess(pd_argv(str(tiny_ckpt), free_port()), env_for(root, NO_COMPILER_PATH), tmp_path / "warm.log")
    try:
        warm.wait_ready(30)
        assert "Compile cache hit (local)" in warm.log()
    finally:
        warm.stop()
