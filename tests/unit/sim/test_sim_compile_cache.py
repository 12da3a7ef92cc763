"""The sim's model of the vLLM Neuron plugin's compile cache (compilation_cache.md; docs/sim.md "Compile cache")."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from epd_kit.sim import compile_cache as cc
from epd_kit.sim.launch import STANDIN_BIN

SHAPES = {"max_model_len": 4096, "max_num_seqs": 4}


def inputs(env: dict[str, str] | None = None, **kw: object) -> dict:
    args: dict = {"architecture": "Qwen3VLForConditionalGeneration", "role": "pd", "shapes": SHAPES, "tp": 8}
    args.update(kw)
    return cc.key_inputs(target=str(args.pop("target", "trn2")), env=env or {}, **args)


def settings(tmp_path: Path, **env: str) -> cc.CacheSettings:
    """The cache variables under tmp_path, with the sim's stand-in neuronx-cc on PATH (as the kit's units)."""
    return cc.CacheSettings.from_env({"VLLM_CACHE_ROOT": str(tmp_path / "local"), "PATH": str(STANDIN_BIN), **env})


def test_key_is_32_hex_and_follows_every_listed_input_but_not_the_core_slice() -> None:
    base = cc.cache_key(inputs())
    assert len(base) == 32 and int(base, 16) >= 0
    assert cc.cache_key(inputs()) == base  # same configuration on other cores/hosts: same key
    changed = [
        inputs(tp=4),  # collective replica groups
        inputs(shapes={**SHAPES, "max_model_len": 8192}),  # input shapes (buckets)
        inputs(role="ve"),  # graph
        inputs(target="trn3"),  # platform target
        inputs({"NEURON_CC_FLAGS": "--optlevel=1"}),  # compiler args
        inputs({"EPD_SIM_NEURON_SDK": "2.28-sim"}),  # torch-neuronx / neuronx-cc / NKI versions
    ]
    assert len({base, *(cc.cache_key(i) for i in changed)}) == len(changed) + 1
    # compiler args are canonicalised: order does not matter
    assert cc.cache_key(inputs({"NEURON_CC_FLAGS": "-a -b"})) == cc.cache_key(inputs({"NEURON_CC_FLAGS": "-b  -a"}))


def test_settings_follow_the_plugins_variables(tmp_path: Path) -> None:
    default = cc.CacheSettings.from_env({"HOME": "/var/cache/epd"})
    assert default.local_dir == Path("/var/cache/epd/.cache/vllm/neuron/compile_cache")
    assert default.remote_dir is None and default.lock_timeout_s == 600 and default.target == "trn2"
    s = settings(tmp_path, NEURON_LIBTORCH_REMOTE_CACHE="/mnt/fsx/c", NEURON_LIBTORCH_COMPILATION_TIMEOUT="30")
    assert s.local_dir == tmp_path / "local/neuron/compile_cache"
    assert s.remote_dir == Path("/mnt/fsx/c") and s.lock_timeout_s == 30


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"VLLM_NEURON_DISABLE_WARMUP_COMPILE": "1", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE": "1"},
            "incompatible",
        ),
        ({"VLLM_NEURON_CPU_COMPILE": "1"}, "requires NEURON_PLATFORM_TARGET_OVERRIDE"),
        (
            {"VLLM_NEURON_CPU_COMPILE": "1", "NEURON_PLATFORM_TARGET_OVERRIDE": "trn2", "VLLM_NEURON_CPU_MODE": "1"},
            "cannot be enabled together",
        ),
    ],
)
def test_refused_combinations(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(tmp_path, **env)


def run(s: cc.CacheSettings, key: str, compile_s: float = 0, fetch_s: float = 0) -> cc.Outcome:
    return asyncio.run(cc.load_or_compile(s, key, {"k": key}, compile_s=compile_s, fetch_s=fetch_s, engine="e"))


def test_miss_compiles_then_local_hit_then_remote_fetch_on_another_host(tmp_path: Path) -> None:
    key = "a" * 32
    remote = tmp_path / "shared"
    remote.mkdir()
    host_a = settings(tmp_path, NEURON_LIBTORCH_REMOTE_CACHE=str(remote))
    assert run(host_a, key).source == "compiled"
    assert run(host_a, key).source == "local"
    assert cc.save_cache(host_a.local_dir, remote, key) is True
    assert cc.save_cache(host_a.local_dir, remote, key) is False  # promoted already: a no-op
    assert not [p for p in remote.iterdir() if p.name.startswith(".staging")]
    # host b has no compiler on PATH: a fetch and a local hit need none
    host_b = cc.CacheSettings.from_env(
        {"VLLM_CACHE_ROOT": str(tmp_path / "b"), "NEURON_LIBTORCH_REMOTE_CACHE": str(remote), "PATH": "/nonexistent"}
    )
    assert host_b.compiler is None
    assert run(host_b, key, fetch_s=0.05, compile_s=5).source == "remote"  # fetched: no 5 s compile
    assert run(host_b, key).source == "local"


@pytest.mark.parametrize("env", [{}, {"NEURON_LIBTORCH_DISABLE_COMPILE_CACHE": "1"}])
def test_a_miss_without_neuronx_cc_on_path_fails_naming_the_compiler_and_path(tmp_path: Path, env) -> None:
    s = settings(tmp_path, PATH=f"/nonexistent{os.pathsep}{tmp_path}", **env)
    assert s.compiler is None
    with pytest.raises(cc.CompileFailure, match=r"neuronx-cc not found on PATH: graph e{32} of engine e .*bin"):
        run(s, "e" * 32)
    assert not list(s.local_dir.glob("?" * 32))  # nothing compiled, nothing stored
    assert settings(tmp_path).compiler == str(STANDIN_BIN / "neuronx-cc")


def test_two_engines_of_one_host_compile_a_key_once(tmp_path: Path) -> None:
    s = settings(tmp_path)

    async def both() -> list[cc.Outcome]:
        kw = {"compile_s": 0.3, "fetch_s": 0.0, "engine": "e"}
        return list(await asyncio.gather(*(cc.load_or_compile(s, "b" * 32, {}, **kw) for _ in range(2))))

    outcomes = asyncio.run(both())
    assert sorted(o.source for o in outcomes) == ["compiled", "local"]


def test_strict_mode_miss_names_the_engine_and_the_remedy(tmp_path: Path) -> None:
    s = settings(tmp_path, VLLM_NEURON_DISABLE_WARMUP_COMPILE="1", NEURON_LIBTORCH_REMOTE_CACHE=str(tmp_path))
    with pytest.raises(cc.CompileFailure, match=r"graph c{32} of engine e .*playbooks/precompile.yml"):
        run(s, "c" * 32)


def test_save_cache_refuses_an_incomplete_entry(tmp_path: Path) -> None:
    (tmp_path / "local" / ("d" * 32)).mkdir(parents=True)
    with pytest.raises(RuntimeError, match="incomplete"):
        cc.save_cache(tmp_path / "local", tmp_path, "d" * 32)
