"""The files every sandbox host gets before boot (hosts.sh SEED=DIR): the tiny
Qwen3-VL-style checkpoint at /models/tiny-qwen3-vl, standing in for the checkpoint an
operator places on a trn2 host before deploying. Cached under KIT_DIR, keyed by the
checkpoint builder's source, so it is built once per change.

    python tests/hosts/seed.py      prints the seed directory (builds it if needed)
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import inspect
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.hosts.harness import HOST_MODEL_DIR, hosts_env

CHECKPOINT_MODULE = "epd_kit.testing.checkpoint"


def _builder():
    try:
        module = importlib.import_module(CHECKPOINT_MODULE)
    except ImportError as exc:
        raise RuntimeError(
            f"{CHECKPOINT_MODULE} is not available yet ({exc}): the sandbox model cannot be built"
        ) from exc
    for name in ("build_checkpoint", "write_checkpoint", "make_checkpoint", "build_tiny_checkpoint"):
        if callable(getattr(module, name, None)):
            return module, getattr(module, name)
    raise RuntimeError(f"{CHECKPOINT_MODULE} has no build_checkpoint(directory) function")


def seed_dir() -> Path:
    module, build = _builder()
    digest = hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:12]
    root = Path(hosts_env()["KIT_DIR"]) / f"seed-{digest}"
    if (root / HOST_MODEL_DIR.lstrip("/") / "config.json").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / HOST_MODEL_DIR.lstrip("/") / "config.json").exists():
            return root
        tmp = Path(f"{root}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model = tmp / HOST_MODEL_DIR.lstrip("/")
        model.mkdir(parents=True)
        build(model)
        # world-readable: the engines run as the unprivileged user epd
        for p in [tmp, *tmp.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        tmp.rename(root)
    return root


if __name__ == "__main__":
    print(seed_dir())
