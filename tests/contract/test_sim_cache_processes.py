"""The sim's compile cache across real engine processes (compilation_cache.md; docs/sim.md "Compile cache"):
two engines of one host compile a graph once, a strict-mode miss fails the start with the engine
and the remedy, CPU compile mode compiles then serves /health and refuses generation until
stopped, and a host with the shared tier fetches."""

from __future__ import annotations

from pathlib import Path

import httpx
from sim_harness import PD_CORES, Launcher, engine_env, free_port, pd_argv

from epd_kit.wire import GENERATE_PATH

COMPILE_S = "1.0"  # long enough for the second engine to find the first one's lock


def pd_env(root: Path, **env: str) -> dict[str, str]:
    out = engine_env(PD_CORES, compile_s=COMPILE_S)
    out.update({"VLLM_CACHE_ROOT": str(root), **env})
    return out


def test_two_engines_of_one_host_compile_once_then_a_restart_is_a_local_hit(
    launcher: Launcher, checkpoint, tmp_path: Path
) -> None:
    root = tmp_path / "host-a"
    engines = [
        launcher.start(pd_argv(str(checkpoint.path), free_port(), engine_id=f"epd-pd-{i}"), pd_env(root), f"pd{i}")
        for i in range(2)
    ]
    for engine in engines:
        engine.wait_ready()
    logs = "".join(engine.log() for engine in engines)
    assert logs.count("Compile cache miss: compiling graph") == 1
    assert "is being compiled by another process of this host" in logs
    assert len(list((root / "neuron/compile_cache").glob("?" * 32))) == 1
    again = launcher.start(pd_argv(str(checkpoint.path), free_port()), pd_env(root), "pd-again").wait_ready()
    assert "Compile cache hit (local)" in again.log()


def test_cpu_compile_then_strict_engines_fetch_and_a_missing_key_fails_fast(
    launcher: Launcher, checkpoint, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    model = str(checkpoint.path)
    cpu = {"VLLM_NEURON_CPU_COMPILE": "1", "NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}
    builder = launcher.start(pd_argv(model, free_port()), pd_env(tmp_path / "cpu", **cpu), "cpu")
    # it does not exit by itself (no source says vllm serve does): /health 200 once compiled,
    # generation refused (nothing executes), a clean exit when stopped, as precompile.yml does
    builder.wait_ready(20)
    assert "CPU compilation complete" in builder.log()
    refused = httpx.post(builder.url + GENERATE_PATH, json={"prompt": "hi"}, timeout=5)
    assert refused.status_code == 503 and "CPU compile mode" in refused.json()["error"]["message"]
    assert builder.returncode is None
    assert builder.stop() == 0
    from epd_kit.sim.compile_cache import save_cache  # what promote-compile-cache runs

    (key,) = [p.name for p in (tmp_path / "cpu/neuron/compile_cache").glob("?" * 32)]
    assert save_cache(tmp_path / "cpu/neuron/compile_cache", shared, key)
    strict = {"NEURON_LIBTORCH_REMOTE_CACHE": str(shared), "VLLM_NEURON_DISABLE_WARMUP_COMPILE": "1"}
    warm = launcher.start(pd_argv(model, free_port()), pd_env(tmp_path / "trn2", **strict), "strict").wait_ready()
    assert f"fetching graph {key} from remote" in warm.log() and "compiling graph" not in warm.log()
    # another configuration (max_model_len) was not precompiled: the engine fails at once, naming itself
    missing = launcher.start(
        pd_argv(model, free_port(), max_model_len=1024, engine_id="epd-n2-pd-1"),
        pd_env(tmp_path / "trn2-b", **strict),
        "missing",
    )
    assert missing.wait_exit(20) == 1
    log = missing.log()
    assert "RuntimeError: Cache miss for graph" in log and "of engine epd-n2-pd-1" in log
    assert "playbooks/precompile.yml" in log and "compiling graph" not in log
