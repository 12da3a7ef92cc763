"""Two models on one fleet (inventory/sandbox/two-models: the vision model's VE + PD and the
text-only model "text" on a PD of its own, with the router, on n1), deployed with the real
playbook over SSH: each model answers the real openai client through the one router from its own
engine units (epd-engine@text-pd-0 is the text model's), an unknown model is OpenAI's 404, an
inventory whose models do not fit is refused in deploy's controller preflight, before any host is
touched (every engine keeps its process, no file changes), a rolling restart of the text model's
engine drains it in its own pool, a deploy that adds a model while it rolls the text model's
engine serves the new model without a failed request, and a deploy without the further models
drains their engines in their own pools, stops them and drops the models from the router;
`vllm bench serve` runs against each deployed model. Lane a (not in tests/e2e/conftest.py
LANE_B); 133 s in a run here (docs/sandbox.md)."""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.budget import scaled
from tests.e2e.conftest import DEPLOY, deploy_stack, sandbox_inventory
from tests.e2e.stack import Stack, image_message, under_load
from tests.hosts.harness import HostPool, ansible_playbook
from tests.vllm_dist import bench_serve, compat_python

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(600)]

UNITS = ("epd-engine@pd-0.service", "epd-engine@ve-0.service", "epd-engine@text-pd-0.service", "epd-router@0.service")


@pytest.fixture(scope="module")
def stack(host_pool: HostPool, record_timing, tmp_path_factory) -> Stack:
    return deploy_stack(host_pool, sandbox_inventory("two-models", tmp_path_factory), record_timing, "two models")


def main_pids(stack: Stack) -> dict[str, str]:
    host = stack.hosts["n1"]
    return {unit: host.show(unit, "MainPID")["MainPID"] for unit in UNITS}


def test_each_model_answers_through_the_one_router_from_its_own_engines(stack: Stack):
    host = stack.hosts["n1"]
    assert host.run("systemctl is-active " + " ".join(UNITS)).stdout.split() == ["active"] * len(UNITS)
    client = stack.openai()
    assert [m.id for m in client.models.list().data] == ["vision", "text"]
    before = {e["id"]: e["served"] for e in stack.pools()}
    vision = client.chat.completions.create(
        model="vision", messages=image_message("What is in this picture?", (200, 30, 30)), max_tokens=8
    )
    assert vision.model == "vision" and vision.choices[0].message.content
    text = client.chat.completions.create(
        model="text", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    assert text.model == "text" and text.choices[0].message.content
    after = {e["id"]: e for e in stack.pools()}
    assert {i: after[i]["served"] - before[i] for i in after} == {"epd-ve-0": 1, "epd-pd-0": 1, "epd-text-pd-0": 1}
    assert after["epd-text-pd-0"]["model"] == "text" and after["epd-pd-0"]["model"] == "vision"
    print(f"vision: {vision.choices[0].message.content!r}; text: {text.choices[0].message.content!r}")


def test_an_unknown_model_is_openai_404_and_the_text_model_refuses_images(stack: Stack):
    from openai import BadRequestError, NotFoundError

    client = stack.openai()
    with pytest.raises(NotFoundError) as refused:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.body["code"] == "model_not_found"
    assert refused.value.body["message"].startswith(
        "The model `gpt-4o` does not exist: this router serves vision, text"
    )
    with pytest.raises(BadRequestError, match="text-only"):
        client.chat.completions.create(model="text", messages=image_message("What is this?", (30, 30, 200)))
    with stack.http(5) as http:
        assert http.get("/ready", params={"model": "text"}).json() == {"ready": True}


@pytest.fixture(scope="module")
def bench_runs(stack: Stack, host_pool: HostPool, tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """vLLM's own benchmark client (vllm 0.24.0's `vllm bench serve`, the compat env) against the
    deployed router, both models' runs in one vLLM process (tests/vllm_dist.py bench_serve): 10
    requests to each model, one random image each for `vision`."""
    python = compat_python()
    if python is None:
        pytest.skip("the vLLM-compat venv is not built (yet): scripts/compat-env.sh --vllm 0.24.0 builds it")
    assert host_pool.seed is not None
    tokenizer = str(host_pool.seed / "models/tiny-qwen3-vl")  # what the hosts carry at /models/tiny-qwen3-vl
    images = {"vision": True, "text": False}
    return bench_serve(python, stack.router_url, tokenizer, 10, images=images, cwd=tmp_path_factory.mktemp("bench"))


@pytest.mark.parametrize("model", ["vision", "text"])
def test_vllm_bench_serve_runs_against_each_deployed_model(bench_runs: dict[str, tuple[int, str, str]], model):
    """`vllm bench serve` against each deployed model through the router: all 10 answered."""
    status, summary, stderr = bench_runs[model]
    print(f"vllm bench serve --model {model} against the sandbox (exit {status}):\n{summary}")
    assert status == 0, stderr
    assert re.search(r"Successful requests:\s+10\b", summary) and re.search(r"Failed requests:\s+0\b", summary), summary


def test_models_that_do_not_fit_are_refused_before_any_host_is_touched(stack: Stack, tmp_path: Path):
    bad = shutil.copytree(stack.inventory.directory, tmp_path / "inventory")
    models = bad / "group_vars/all/models.yml"
    doc = yaml.safe_load(models.read_text())
    doc["epd_models"][0]["num_pd"] = 3  # 3 x 8 cores beside the vision model's 12, on 24
    models.write_text(yaml.safe_dump(doc))
    pids = main_pids(stack)
    files = stack.hosts["n1"].run("find /etc/epd /etc/systemd/system -type f | sort | xargs sha256sum").stdout
    result = ansible_playbook(bad, DEPLOY, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "n1: model text does not fit: it asks for 0 VE (tp 4) + 3 PD (tp 8) = 24 cores" in output, output[-3000:]
    assert "Preflight on every host" not in output, "the deploy went past the controller's check"
    assert main_pids(stack) == pids
    assert stack.hosts["n1"].run("find /etc/epd /etc/systemd/system -type f | sort | xargs sha256sum").stdout == files


def test_a_rolling_restart_of_the_text_models_engine_drains_it_in_its_own_pool(stack: Stack, record_timing):
    """rolling_restart.yml -e engines=text-pd-0: the router drains it in the `text` entry's endpoints
    (a reload: the router process keeps its PID), the unit restarts, the vision model's engines
    keep theirs, and both models answer after."""
    pids = main_pids(stack)
    start = time.monotonic()
    result = ansible_playbook(stack.inventory.directory, "playbooks/rolling_restart.yml", "-e", "engines=text-pd-0")
    record_timing("two models: rolling restart of text-pd-0", time.monotonic() - start)
    assert result.returncode == 0, result.describe()
    after = main_pids(stack)
    changed = {unit for unit in UNITS if after[unit] != pids[unit]}
    assert changed == {"epd-engine@text-pd-0.service"}
    stack.wait_ready(timeout=60)
    client = stack.openai()
    for model in ("vision", "text"):
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert answer.model == model


def test_a_deploy_adding_a_model_while_it_rolls_an_engine_serves_it_without_a_failed_request(
    stack: Stack, record_timing
):
    """One deploy adds the text-only model `small` (a tp4 PD on n1's 4 spare cores) and changes the
    text model's engine (its max_num_seqs): epd-engine@text-pd-0 rolls through the router, drained
    in its own pool by the batch's writes, which change router.yaml's endpoints alone; the router
    play then finds `models` changed and rolls the router's process, so `small` is served. Under
    bounded load on `vision` (8/s) no request fails; the vision engines keep their processes."""
    host = stack.hosts["n1"]
    models = stack.inventory.directory / "group_vars/all/models.yml"
    doc = yaml.safe_load(models.read_text())
    doc["epd_models"][0]["max_num_seqs"] = 4
    doc["epd_models"].append({"name": "small", "model": "/models/tiny-qwen3-vl", "text_only": True, "pd_tp": 4})
    models.write_text(yaml.safe_dump(doc))
    before = main_pids(stack)
    result, elapsed = under_load(stack, DEPLOY, limit_s=450)
    record_timing("two models: deploy adding a model and rolling text-pd-0, under load", elapsed)
    assert "batch 1/1 PD canary: epd-text-pd-0" in result.stdout, result.describe()
    after = main_pids(stack)
    assert {unit for unit in UNITS if after[unit] != before[unit]} == {
        "epd-engine@text-pd-0.service",
        "epd-router@0.service",
    }
    assert (
        "--max-num-seqs 4"
        in host.run("tr '\\0' ' ' < /proc/$(systemctl show -pMainPID --value epd-engine@text-pd-0)/cmdline").stdout
    )
    assert host.run("systemctl is-active epd-engine@small-pd-0.service", check=False).stdout.strip() == "active"
    stack.wait_ready(timeout=60)
    client = stack.openai()
    assert [m.id for m in client.models.list().data] == ["vision", "text", "small"]
    answer = client.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.model == "small" and answer.choices[0].message.content
    assert stack.engine("epd-small-pd-0")["model"] == "small"


class PoolsWatch:
    """Samples the router's GET /pools every 0.5 s in a thread while a playbook runs (bounded: at
    most `max_seconds`): each engine's states seen, in order."""

    def __init__(self, stack: Stack, max_seconds: float) -> None:
        self.stack, self.max_seconds = stack, max_seconds
        self.states: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pools-watch", daemon=True)

    def __enter__(self) -> PoolsWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - start < self.max_seconds:
            try:
                for engine in self.stack.pools():
                    seen = self.states.setdefault(engine["id"], [])
                    if not seen or seen[-1] != engine["state"]:
                        seen.append(engine["state"])
            except Exception:  # the router's process rolling, or a slow answer: the next sample
                pass
            self._stop.wait(0.5)


def test_removing_the_text_model_stops_its_engine_and_the_router_drops_it(stack: Stack, record_timing):
    """A deploy without the epd_models entries (last: it changes the stack): the router, still
    serving the models (its `models` is read at start), first drains their engines in their own
    pools (GET /pools shows each `draining`, the retire step waits until none has a request in
    flight), then their units are stopped and disabled, their env files removed, the router's
    process rolls (a new one, without the lanes), and /v1/models lists `vision` alone, answering
    from its engines, which kept their processes."""
    host = stack.hosts["n1"]
    before = main_pids(stack)
    vision_pids = {unit: pid for unit, pid in before.items() if "text" not in unit and "router" not in unit}
    removed = [e["id"] for e in stack.pools() if e["model"] != "vision"]
    assert "epd-text-pd-0" in removed
    (stack.inventory.directory / "group_vars/all/models.yml").unlink()
    start = time.monotonic()
    with PoolsWatch(stack, max_seconds=scaled(400)) as watch:  # as long as the deploy's budget
        result = ansible_playbook(stack.inventory.directory, DEPLOY, timeout=400)
    record_timing("two models: deploy removing the further models", time.monotonic() - start)
    assert result.returncode == 0, result.describe()
    drain = result.stdout.split("no request in flight on them]", 1)[-1].split("TASK [", 1)[0]
    assert "ok: [n1]" in drain, result.describe()
    assert {engine: watch.states.get(engine) for engine in removed} == {
        engine: ["active", "draining"] for engine in removed
    }, watch.states
    assert host.units("epd-engine@*") == ["epd-engine@pd-0.service", "epd-engine@ve-0.service"]
    assert host.run("test -e /etc/epd/engines/text-pd-0.env", check=False).returncode != 0
    after = main_pids(stack)
    assert {unit: after[unit] for unit in vision_pids} == vision_pids
    assert after["epd-router@0.service"] not in ("0", before["epd-router@0.service"])
    stack.wait_ready(timeout=60)
    client = stack.openai()
    assert [m.id for m in client.models.list().data] == ["vision"]
    assert client.chat.completions.create(model="vision", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert [e["id"] for e in stack.pools()] == ["epd-ve-0", "epd-pd-0"]
