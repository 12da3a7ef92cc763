"""The vLLM Neuron plugin's two-tier compilation cache, as the sim models it (docs/sim.md "Compile cache").

Source for every behaviour here: aws-neuron/aws-neuron-sdk
vllm-neuron/docs/design/compilation/compilation_cache.md (CC) and cpu_compilation.md (CPU).
- local tier $VLLM_CACHE_ROOT/neuron/compile_cache/<key>/, default ~/.cache/vllm (CC "Cache Tiers")
- remote tier $NEURON_LIBTORCH_REMOTE_CACHE/<key>/, read on a local miss (CC "Cache Tiers")
- flow: fast local check, else per-key lock, re-check, remote fetch, else compile (CC "Compilation
  Decision Flow"); the lock wait is bounded by NEURON_LIBTORCH_COMPILATION_TIMEOUT, 600 s (CC "Environment
  Variables")
- key: MD5 (32 chars) of graph, input metadata, torch_neuronx / neuronxcc / NKI versions, canonical
  compiler args, platform target, collective replica groups; device indices normalised, so the
  core slice is not in it (CC "Cache Key")
- VLLM_NEURON_DISABLE_WARMUP_COMPILE=1: a local miss is a RuntimeError; incompatible with
  NEURON_LIBTORCH_DISABLE_COMPILE_CACHE=1, which compiles with no cache (CC "Environment Variables")
- promotion is explicit, save_cache(local, remote, key): copy to staging on the remote, atomic
  rename, a no-op when already promoted, RuntimeError on an incomplete local entry (CC "API Reference")
- VLLM_NEURON_CPU_COMPILE=1 needs NEURON_PLATFORM_TARGET_OVERRIDE; compiles, runs nothing (CPU)
- compiling needs neuronx-cc on PATH ("neuronx-cc is on your PATH (activate the Neuron virtual
  environment if you use one)", aws-neuron-sdk compiler/neuronx-cc/how-to-generate-neff.rst); a
  hit, local or remote, does not. No source gives the engine's own message for a missing compiler:
  the sim's (_compiler) is its own, a RuntimeError at startup, exit 1 (docs/sim.md)

The sim keeps one key per engine configuration (the real plugin keeps one per graph and bucket);
what matters to the kit, where a key lives and when it is compiled or fetched, is the same.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .release import sim_sdk

log = logging.getLogger("epd_sim.compile_cache")

# the sim's stand-in versions: its release's compiler series (release.sim_sdk, "2.27-sim" for Neuron
# 2.32); EPD_SIM_NEURON_SDK overrides them all at once (a simulated SDK upgrade)
SIM_NEURON_SDK = sim_sdk({})
DEFAULT_TARGET = "trn2"  # what a trn2 host detects (CC "Cache Key": platform target)
DEFAULT_LOCK_TIMEOUT_S = 600.0  # NEURON_LIBTORCH_COMPILATION_TIMEOUT default (CC)
ARTIFACT = "model.neff"
COMPILER = "neuronx-cc"
META = "key.json"
_LOCK_POLL_S = 0.05


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "0").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class CacheSettings:
    """The plugin's cache variables, read from the engine's environment."""

    local_dir: Path
    remote_dir: Path | None
    disabled: bool  # NEURON_LIBTORCH_DISABLE_COMPILE_CACHE
    strict: bool  # VLLM_NEURON_DISABLE_WARMUP_COMPILE
    cpu_compile: bool  # VLLM_NEURON_CPU_COMPILE
    target: str
    lock_timeout_s: float
    compiler: str | None = None  # neuronx-cc as the engine's PATH finds it; None: not on PATH

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> CacheSettings:
        """Raises ValueError with the message the engine prints for a combination the plugin refuses."""
        root = env.get("VLLM_CACHE_ROOT") or str(Path(env.get("HOME") or Path.home()) / ".cache" / "vllm")
        remote = env.get("NEURON_LIBTORCH_REMOTE_CACHE") or None
        disabled = _flag(env, "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE")
        strict = _flag(env, "VLLM_NEURON_DISABLE_WARMUP_COMPILE")
        cpu_compile = _flag(env, "VLLM_NEURON_CPU_COMPILE")
        if disabled and strict:
            raise ValueError(
                "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 is incompatible with NEURON_LIBTORCH_DISABLE_COMPILE_CACHE=1"
            )
        override = env.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip()
        if cpu_compile and not override:
            raise ValueError(
                "VLLM_NEURON_CPU_COMPILE=1 requires NEURON_PLATFORM_TARGET_OVERRIDE (e.g. trn2): "
                "no Neuron device to detect the target from"
            )
        if cpu_compile and _flag(env, "VLLM_NEURON_CPU_MODE"):
            raise ValueError("VLLM_NEURON_CPU_COMPILE and VLLM_NEURON_CPU_MODE cannot be enabled together")
        return cls(
            local_dir=Path(root) / "neuron" / "compile_cache",
            remote_dir=Path(remote) if remote else None,
            disabled=disabled,
            strict=strict,
            cpu_compile=cpu_compile,
            target=override or DEFAULT_TARGET,
            lock_timeout_s=float(env.get("NEURON_LIBTORCH_COMPILATION_TIMEOUT") or DEFAULT_LOCK_TIMEOUT_S),
            # no PATH at all: the default search path, as execvp uses it
            compiler=shutil.which(COMPILER, path=env.get("PATH", os.defpath)),
        )


def key_inputs(
    *,
    architecture: str,
    role: str,
    shapes: Mapping[str, Any],
    tp: int,
    target: str,
    env: Mapping[str, str],
) -> dict[str, Any]:
    """What goes into the key (CC "Cache Key"), as the sim knows it: no core slice, no port, no id."""
    sdk = env.get("EPD_SIM_NEURON_SDK") or sim_sdk(env)
    return {
        "graph": {"architecture": architecture, "role": role},
        "inputs": dict(sorted(shapes.items())),
        "torch_neuronx": sdk,
        "neuronxcc": sdk,
        "nki": sdk,
        "compiler_args": sorted(env.get("NEURON_CC_FLAGS", "").split()),
        "target": target,
        "replica_groups": [list(range(tp))],
    }


def cache_key(inputs: Mapping[str, Any]) -> str:
    return hashlib.md5(json.dumps(inputs, sort_keys=True).encode()).hexdigest()  # the plugin's key is an MD5


def _complete(entry: Path) -> bool:
    return (entry / ARTIFACT).is_file() and (entry / META).is_file()


def _write_entry(entry: Path, key: str, inputs: Mapping[str, Any]) -> None:
    """Artifacts land in a temporary directory renamed into place: a key directory is always whole."""
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / ARTIFACT).write_bytes(b"sim-neff:" + key.encode())
    (tmp / META).write_text(json.dumps({"key": key, "inputs": inputs}, sort_keys=True))
    if entry.exists():
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, entry)


def _copy_entry(source: Path, entry: Path) -> None:
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if entry.exists():
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, entry)


class CompileFailure(RuntimeError):
    """The engine cannot get its graphs: strict mode miss, no compiler, or a lock wait over the timeout."""


def _compiler(settings: CacheSettings, key: str, engine: str) -> str:
    """The compiler a miss needs; its absence fails the start only now, after every cache tier missed."""
    if settings.compiler is None:
        raise CompileFailure(
            f"{COMPILER} not found on PATH: graph {key} of engine {engine} is not in the compile cache and "
            f"compiling it needs the Neuron compiler. Put the engine venv's bin directory (where the "
            f"neuronx-cc wheel installs {COMPILER}) first on the engine's PATH, or precompile this "
            "engine configuration into the shared tier (playbooks/precompile.yml)"
        )
    return settings.compiler


@dataclass(frozen=True)
class Outcome:
    key: str
    source: str  # local | remote | compiled | uncached
    seconds: float


async def load_or_compile(
    settings: CacheSettings,
    key: str,
    inputs: Mapping[str, Any],
    *,
    compile_s: float,
    fetch_s: float,
    engine: str,
) -> Outcome:
    """The plugin's decision flow for one key (CC "Compilation Decision Flow")."""
    start = time.monotonic()
    if settings.disabled:
        _compiler(settings, key, engine)
        log.info("Compile cache disabled (NEURON_LIBTORCH_DISABLE_COMPILE_CACHE=1): compiling graph %s", key)
        await asyncio.sleep(compile_s)
        return Outcome(key, "uncached", time.monotonic() - start)
    entry = settings.local_dir / key
    if _complete(entry):  # fast check, no lock
        log.info("Compile cache hit (local) for graph %s at %s", key, entry)
        return Outcome(key, "local", time.monotonic() - start)
    settings.local_dir.mkdir(parents=True, exist_ok=True)
    lock = os.open(settings.local_dir / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o640)  # one lock file per key
    try:
        waited = await _acquire(lock, settings.lock_timeout_s, key)
        if _complete(entry):
            log.info("Compile cache hit (local, after waiting %.1f s for its compiler) for graph %s", waited, key)
            return Outcome(key, "local", time.monotonic() - start)
        remote = settings.remote_dir / key if settings.remote_dir else None
        if remote is not None and _complete(remote):
            log.info("Compile cache miss (local); fetching graph %s from remote %s", key, remote)
            await asyncio.sleep(fetch_s)
            _copy_entry(remote, entry)
            log.info("Fetched graph %s from the remote cache (%.1f s)", key, time.monotonic() - start)
            return Outcome(key, "remote", time.monotonic() - start)
        if settings.strict:
            where = f"local {settings.local_dir}" + (f" or remote {settings.remote_dir}" if remote else "")
            raise CompileFailure(
                f"Cache miss for graph {key} of engine {engine} with VLLM_NEURON_DISABLE_WARMUP_COMPILE=1: "
                f"not in the {where} cache. Precompile this engine configuration into the shared "
                "tier (playbooks/precompile.yml) or turn strict mode off (epd_compile_cache_strict: false)"
            )
        compiler = _compiler(settings, key, engine)
        log.info(
            "Compile cache miss: compiling graph %s for %s with %s (simulated, %.1f s)",
            key,
            settings.target,
            compiler,
            compile_s,
        )
        await asyncio.sleep(compile_s)
        _write_entry(entry, key, inputs)
        log.info("Compiled graph %s and stored it at %s", key, entry)
        return Outcome(key, "compiled", time.monotonic() - start)
    finally:
        os.close(lock)  # releases the lock


async def _acquire(lock: int, timeout_s: float, key: str) -> float:
    """The per-key lock: one process of the host compiles or fetches, the others wait for it."""
    start = time.monotonic()
    announced = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return time.monotonic() - start
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if not announced:
            log.info("Graph %s is being compiled by another process of this host; waiting for it", key)
            announced = True
        if time.monotonic() - start > timeout_s:
            raise CompileFailure(
                f"timed out after {timeout_s:.0f} s waiting for another process to compile graph {key} "
                "(NEURON_LIBTORCH_COMPILATION_TIMEOUT)"
            )
        await asyncio.sleep(_LOCK_POLL_S)


def save_cache(local_cache_dir: str | Path, remote_cache_dir: str | Path, hash_key: str) -> bool:
    """Stand-in for libtorch_neuronx_lite.compile.save_cache (CC "API Reference"): True when it
    promoted the entry, False when another node already had (a no-op)."""
    local = Path(local_cache_dir) / hash_key
    remote_root = Path(remote_cache_dir)
    final = remote_root / hash_key
    if not _complete(local):
        raise RuntimeError(f"local cache entry {local} is incomplete")
    if final.exists():
        return False
    staging = remote_root / f".staging-{hash_key}-{os.uname().nodename}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(local, staging)
    try:
        os.rename(staging, final)  # atomic; a directory already there (EEXIST/ENOTEMPTY): promoted elsewhere
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    return True
