"""One host (inventory/sandbox/one-host: 1 VE + 2 PD + router on n1), deployed with the real
playbook over SSH, driven with systemctl and the real openai client, and watched by the real
Prometheus server. Tests run in file order on one deployment; each leaves the stack as it found
it, except the last (teardown).

Observability (docs/observability.md) rides on the same stack instead of booting one of its own:
the deploy's last play writes the scrape targets and a prometheus.yml on the controller (group
epd_monitoring = localhost), Prometheus (Debian's package) scrapes the host from there, and PromQL
over its HTTP API (127.0.0.1 only) shows every target up and a request moving the router's
request, TTFT and encode series and the VE's prompt-token series. For that the inventory differs
from inventory/sandbox/one-host in three ways: the engines bind to n1's address (a Prometheus off
the host must reach them), the sim compiles for EPD_SIM_COMPILE_S on a compile-cache miss (so a
restart after the cache is cleared prints each engine's progress), and the epd_monitoring group.

Traces (docs/observability.md "Traces") ride on it too: the first deploy names a collector,
`epd_otlp_traces_endpoint`, that is the kit's OTLP/HTTP test receiver (epd_kit.testing.otlp) in
this process on the controller's hub address; a traced image request's spans, the router's and
each engine's, arrive there under the client's trace. n1 is also a monitoring host, with no
setting of its own: the same deploy installs the trace store there by default (Arize Phoenix,
docs/observability.md "Trace store"; the controller, the other monitoring host, is passed over),
which the operator's collector overrides. A re-deploy before the text-only one removes the
setting: the fleet then exports to its store, the default, and a traced image chat is found in
Phoenix by its trace id through Phoenix's REST API, from the controller (a monitoring host, which
the store's access rule lets in), with the router's, the VE's and the PD's spans under the one
trace; the receiver gets nothing.

The layout advisor (docs/advisor.md) comes last before the check, the text-only redeploy and
the teardown: a slow
simulated VE (EPD_SIM_ENCODE_MS_PER_1K_PATCHES, set from the first deploy: about 140 ms per
256x256 image, 2 ms for the 64x64 images of the tests before) under image-heavy load (every
request a new image, Poisson arrivals at the rate that keeps the one VE about 80 % busy, from its
encode time measured on this machine first, then corrected by the busy the advisor's window
measured, so the pool is where the test wants it on a slow, a fast or a busy machine): the
advisor names the VE pool and recommends a second VE on the spare cores; deploy.yml applies it
under load with no failed request; the same load then spends less time in encode and the
advisor recommends no change; an idle window is
"too little traffic". Load and windows are bounded; all traffic goes to the test host n1."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from epd_kit.advise.scrape import parse_text
from epd_kit.advise.window import Window
from epd_kit.router.tracing import REQUEST_SPAN
from epd_kit.testing.otlp import CLIENT, SERVER, OtlpReceiver, client_traceparent
from tests.budget import scaled
from tests.e2e.conftest import deploy_stack
from tests.e2e.stack import LoadGenerator, Stack, image_data_url, image_message, is_healthy, wait_for
from tests.hosts.harness import (
    HUB_ADDRESS,
    REPO,
    HostPool,
    ansible_playbook,
    copy_inventory,
    in_hub_netns,
    machine_address,
)
from tests.prometheus import PrometheusServer

# a first deploy that installs the kit, then a dozen steps on it: more than the default 300 s budget
pytestmark = [pytest.mark.systemd, pytest.mark.timeout(900)]

COMPILE_S = "10"
LOCAL_COMPILE_CACHE = "/var/cache/epd/neuron-compile-cache/neuron/compile_cache"
# the advisor's load: Poisson arrivals at the rate that keeps one VE LOAD_BUSY busy, from the
# encode time of PROBE_REQUESTS new images sent one at a time (nothing queued: service alone, as
# this machine serves it now). One VE then queues longer than it serves (the advisor's queueing
# target, docs/advisor.md "Targets"; a sim encode is nearly constant, so the M/M/1 fit reads it
# ~70 % busy), two VEs ~40 % busy are no bottleneck: both sides with a margin, slow or fast machine
LOAD_BUSY = 0.8
PROBE_REQUESTS = 8
# The probe's rate can miss when the machine's other load changes between the probe and the
# window (a window at 49 % busy beside other engineers' runs, load ~10): a window whose VE ends
# outside BUSY_BAND is taken again at the rate scaled by LOAD_BUSY / its busy, up to
# CALIBRATION_WINDOWS in all, so the load is set by the pool's measured busy, not by one probe.
# The band's floor keeps a margin over the advisor's 50 % bottleneck line (at which a pool's
# fitted queueing already equals its service); 65 % took a second window in a quiet run
BUSY_BAND = (0.55, 0.95)
CALIBRATION_WINDOWS = 3
MAX_RATE_PER_S = 12  # what the router and the load generator keep up with on 2 cores
WINDOW_S = 30  # at least; long enough for WINDOW_REQUESTS at the measured rate
WINDOW_REQUESTS = 150  # the advisor's verdict needs 100 (--min-requests)
STEP_LIMIT_S = 300
# a 256x256 image is 256 patches of 16x16 (already a multiple of patch x merge = 32, so it is not
# resized): 3 + 560 x 256/1024 = 143 ms on the VE (sim/profile.py)
ENCODE_MS_PER_1K_PATCHES = "560"
IMAGE_EDGE = 256
ENGINES = {
    "epd-engine@pd-0.service": "epd-pd-0",
    "epd-engine@pd-1.service": "epd-pd-1",
    "epd-engine@ve-0.service": "epd-ve-0",
}
RED, BLUE = (200, 30, 30), (30, 30, 200)
# traces: the SDK's batch delay of the router's and the engines' exporters (5 s by default), the
# engines' service name (vLLM leaves it unknown_service)
EXPORT_DELAY_MS = "100"
ENGINE_SERVICE = "epd-sandbox-engine"
TRACES_FILE = "group_vars/all/traces.yml"  # epd_otlp_traces_endpoint alone: removing it leaves the store's
# everything the kit writes on a host (teardown must remove all of it; --check must touch none)
KIT_FILES = (
    "/etc/epd /etc/systemd/system/epd-engine@.service /etc/systemd/system/epd-router.service "
    "/etc/systemd/system/epd-router.socket /etc/systemd/system/epd-router@.service "
    "/etc/systemd/system/epd-engines.target /etc/systemd/system/epd.target"
)


def kit_state(host) -> str:
    """Content hashes of the kit's files plus the main PID of every kit unit."""
    files = host.run(f"find {KIT_FILES} -type f 2>/dev/null | sort | xargs -r sha256sum", check=False).stdout
    # the router's process units (epd-router.service groups them and has no main process)
    pids = "\n".join(f"{u}={host.show(u, 'MainPID')['MainPID']}" for u in [*ENGINES, "epd-router@0.service"])
    return files + pids


def monitored_one_host(dest: Path, prometheus_dir: Path, traces_url: str) -> Path:
    """inventory/sandbox/one-host + engines on n1's address + a slow sim compile and encode + epd_monitoring
    + traces to `traces_url`."""
    copy_inventory(REPO / "inventory/sandbox/one-host", dest)
    hosts = yaml.safe_load((dest / "hosts.yml").read_text())
    n1 = hosts["all"]["children"]["epd_engines"]["hosts"]["n1"]
    n1["epd_bind_address"] = n1["ansible_host"]
    # n1 a monitoring host, no setting: the trace store runs there by default (epd_trace_store auto;
    # the controller, the other monitoring host, is a local connection the default passes over)
    hosts["all"]["children"]["epd_monitoring"] = {"hosts": {"n1": {}}}
    (dest / "hosts.yml").write_text(yaml.safe_dump(hosts))
    settings_file = dest / "group_vars/all/epd.yml"
    settings = yaml.safe_load(settings_file.read_text())
    settings["epd_engine_environment"]["EPD_SIM_COMPILE_S"] = COMPILE_S
    settings["epd_engine_environment"]["EPD_SIM_ENCODE_MS_PER_1K_PATCHES"] = ENCODE_MS_PER_1K_PATCHES
    settings["epd_engine_environment"]["OTEL_BSP_SCHEDULE_DELAY"] = EXPORT_DELAY_MS
    settings["epd_engine_environment"]["OTEL_SERVICE_NAME"] = ENGINE_SERVICE
    settings["epd_router_environment"] = {"OTEL_BSP_SCHEDULE_DELAY": EXPORT_DELAY_MS}
    settings_file.write_text(yaml.safe_dump(settings))
    (dest / TRACES_FILE).write_text(yaml.safe_dump({"epd_otlp_traces_endpoint": traces_url}))
    monitoring = {
        "ansible_connection": "local",
        # the controller's address on the sandbox bridge: the host's access rules let Prometheus
        # scrape the engines from there (docs/security.md "Who can reach what")
        "epd_bind_address": HUB_ADDRESS,
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "epd_observability_dir": str(prometheus_dir),
        "epd_observability_prometheus_config": str(prometheus_dir / "prometheus.yml"),
        "epd_observability_scrape_interval_s": 1,
    }
    doc = {"all": {"children": {"epd_monitoring": {"hosts": {"localhost": monitoring}}}}}
    (dest / "monitoring.yml").write_text(yaml.safe_dump(doc))
    return dest


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    """The collector of the fleet's traces: the kit's OTLP/HTTP test receiver in this process, on
    the controller's hub address (the only address of ours the test hosts reach; inside kithub),
    for the module's life: the router and the engines export every traced request to it."""
    if not in_hub_netns():
        pytest.fail("the traces receiver listens on the hub bridge: run inside kithub (scripts/test.sh)", pytrace=False)
    with OtlpReceiver(HUB_ADDRESS) as receiver:
        yield receiver


@pytest.fixture(scope="module")
def one_host_stack(host_pool: HostPool, record_timing, tmp_path_factory, otlp: OtlpReceiver) -> Stack:
    # the operator's first deploy on a host without the kit: the install runs for real here
    tmp = tmp_path_factory.mktemp("one-host")
    inventory = monitored_one_host(tmp / "inventory", tmp / "prometheus", otlp.url)
    return deploy_stack(host_pool, inventory, record_timing, "1 host", preinstalled=False)


@pytest.fixture(scope="module")
def prometheus(one_host_stack: Stack, tmp_path_factory) -> Iterator[PrometheusServer]:
    """The real Prometheus server on 127.0.0.1, reading the prometheus.yml the deploy wrote."""
    config = one_host_stack.inventory.directory.parent / "prometheus/prometheus.yml"
    server = PrometheusServer(config, tmp_path_factory.mktemp("prometheus-server"))
    try:
        yield server
    finally:
        server.stop()


def test_deploy_starts_every_unit_and_the_router_sees_all_engines(one_host_stack):
    n1 = one_host_stack.hosts["n1"]
    for unit in [*ENGINES, "epd-router.service", "epd-engines.target", "epd.target"]:
        assert n1.is_active(unit) == "active", f"{unit}:\n{n1.journal(unit)}"
    # enabled = the stack comes back after a reboot (ask inside the host: see docs/sandbox.md)
    enabled = n1.run(
        "systemctl is-enabled epd.target epd-engines.target epd-router.service " + " ".join(ENGINES)
    ).stdout.split()
    assert set(enabled) == {"enabled"}, enabled
    pools = {e["id"]: e for e in one_host_stack.pools()}
    assert set(pools) == set(ENGINES.values())
    assert all(is_healthy(e) for e in pools.values()), pools
    # the exact command is on the host: unit + env file
    env = n1.run("cat /etc/epd/engines/pd-0.env").stdout
    assert "/models/tiny-qwen3-vl" in env and "NEURON_VISIBLE_DEVICES" in env
    assert n1.run("systemctl cat epd-engine@pd-0.service").stdout.count("--no-enable-prefix-caching") == 1


def test_text_image_and_streaming_requests(one_host_stack):
    stack = one_host_stack
    text = stack.chat([{"role": "user", "content": "Say hello to the sandbox."}], max_tokens=8)
    assert text.choices[0].message.content and text.choices[0].finish_reason in ("length", "stop")
    assert text.usage.completion_tokens <= 8

    red = stack.chat(image_message("What is in the picture?", RED), max_tokens=16)
    red_again = stack.chat(image_message("What is in the picture?", RED), max_tokens=16)
    blue = stack.chat(image_message("What is in the picture?", BLUE), max_tokens=16)
    # the sim's output is a deterministic function of the prompt AND the image embeddings:
    # same image, same answer; another image, another answer (the embedding reached the PD)
    assert red.choices[0].message.content == red_again.choices[0].message.content
    assert red.choices[0].message.content != blue.choices[0].message.content
    assert red.usage.prompt_tokens > text.usage.prompt_tokens  # image tokens are in the prompt

    streamed, last = stack.chat_stream(image_message("What is in the picture?", RED), max_tokens=16)
    assert streamed == red.choices[0].message.content
    assert last.usage is not None and last.usage.completion_tokens == red.usage.completion_tokens


def test_every_router_and_engine_target_is_up(one_host_stack, prometheus):
    def all_up() -> list[dict]:
        targets = prometheus.query('up{role=~"ve|pd|router"}')
        return targets if len(targets) == 4 and all(t["value"][1] == "1" for t in targets) else []

    targets = wait_for(all_up, timeout=60, what="4 targets up in prometheus")
    labels = sorted((t["metric"]["role"], t["metric"]["instance"], t["metric"]["host"]) for t in targets)
    assert labels == [("pd", "pd-0", "n1"), ("pd", "pd-1", "n1"), ("router", "router", "n1"), ("ve", "ve-0", "n1")]
    engine_ids = {t["metric"].get("engine_id") for t in targets if t["metric"]["role"] != "router"}
    assert engine_ids == {e["id"] for e in one_host_stack.pools()}  # the router's endpoints


def test_a_request_moves_the_request_ttft_and_encode_series(one_host_stack, prometheus):
    series = {
        "requests": 'sum(epd_router_requests_total{status="200"})',
        "ttft": "sum(epd_router_time_to_first_token_seconds_count)",
        "encode": "sum(epd_router_encode_seconds_count)",
        "ve prompt tokens": 'sum(vllm:prompt_tokens_total{role="ve"})',
        "pd generated tokens": 'sum(vllm:generation_tokens_total{role="pd"})',
    }
    wait_for(lambda: prometheus.query("epd_router_encode_seconds_count"), timeout=30, what="a router scrape")
    # the value of every series before, once Prometheus has scraped what earlier tests sent
    time.sleep(3)
    before = {name: prometheus.value(q) for name, q in series.items()}
    reply = one_host_stack.chat(image_message("What is in the picture? (observability)", (200, 30, 30)), max_tokens=4)
    assert reply.choices[0].message.content is not None

    def moved() -> dict[str, float]:
        after = {name: prometheus.value(q) for name, q in series.items()}
        return after if all(after[name] > before[name] for name in series) else {}

    after = wait_for(moved, timeout=30, what=f"every series to move from {before}")
    assert after["requests"] == before["requests"] + 1


def test_a_traced_request_exports_the_routers_and_each_engines_spans(one_host_stack, otlp):
    """epd_otlp_traces_endpoint on the deployed fleet: every engine runs with vLLM's flag and the
    OTLP/HTTP protocol, and a client's traced image request leaves, in the collector, the router's
    span tree under the client's span and each engine's `llm_request` under the call that carried
    its traceparent, exported by that engine's process (across the kit's nftables rules)."""
    n1 = one_host_stack.hosts["n1"]
    pids = {}
    for unit, engine_id in ENGINES.items():
        pids[engine_id], argv, environ = n1.main_process(unit)
        assert argv[argv.index("--otlp-traces-endpoint") + 1] == otlp.url, argv
        assert environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") == "http/protobuf", environ
    trace_id, client_span, header = client_traceparent()
    reply = one_host_stack.chat(
        image_message("What is in the picture? (traced)", BLUE), max_tokens=4, extra_headers={"traceparent": header}
    )
    assert reply.choices[0].message.content is not None
    wanted = [REQUEST_SPAN, "receive", "render", "ve encode", "pd generate", "llm_request", "llm_request"]
    spans = otlp.wait_for(trace_id, wanted, timeout=scaled(20))
    assert sorted(s.name for s in spans) == sorted(wanted), spans
    by_name = {s.name: s for s in spans}
    root = by_name[REQUEST_SPAN]
    assert root.parent_id == client_span and root.kind == SERVER and root.service == "epd-router", root
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["epd.request_id"], root
    for name in ("receive", "render", "ve encode", "pd generate"):
        assert by_name[name].parent_id == root.span_id and by_name[name].service == "epd-router", by_name[name]
    calls = {by_name[name].attributes["epd.engine.id"]: by_name[name] for name in ("ve encode", "pd generate")}
    assert {c.kind for c in calls.values()} == {CLIENT}
    assert set(calls) in ({"epd-ve-0", "epd-pd-0"}, {"epd-ve-0", "epd-pd-1"}), calls
    engine_spans = {s.parent_id: s for s in spans if s.name == "llm_request"}
    for engine_id, call in calls.items():  # each engine's span: under its call, from its process
        mine = engine_spans[call.span_id]
        assert mine.kind == SERVER and mine.service == ENGINE_SERVICE, mine
        assert mine.resource["vllm.process_id"] == pids[engine_id], (engine_id, pids, mine)


def test_stopping_one_pd_keeps_serving_and_it_rejoins_on_start(one_host_stack):
    stack, n1 = one_host_stack, one_host_stack.hosts["n1"]
    n1.systemctl("stop", "epd-engine@pd-1.service")
    assert n1.is_active("epd-engine@pd-1.service") == "inactive"
    for i in range(8):
        reply = stack.chat(image_message(f"while pd-1 is stopped #{i}", RED), max_tokens=4)
        assert reply.choices[0].message.content is not None
    stack.wait_engine_health("epd-pd-1", False, timeout=30)
    assert n1.is_active("epd-engines.target") == "active"  # one stopped engine does not take the pool down

    n1.systemctl("start", "epd-engine@pd-1.service", timeout=120)  # returns once /health is 200
    assert n1.is_active("epd-engine@pd-1.service") == "active"
    stack.wait_engine_health("epd-pd-1", True, timeout=30)
    for i in range(4):
        assert stack.chat(image_message(f"after pd-1 rejoined #{i}", BLUE), max_tokens=4).choices


def test_kill_9_restarts_the_engine_and_the_router_readmits_it(one_host_stack):
    stack, n1 = one_host_stack, one_host_stack.hosts["n1"]
    unit = "epd-engine@pd-0.service"
    before = n1.show(unit, "MainPID", "NRestarts")
    n1.run(f"kill -9 {before['MainPID']}")
    # RestartSec (10 s) outlasts the router's health probes (2 x 2 s): it ejects pd-0 first ...
    stack.wait_engine_health("epd-pd-0", False, timeout=15)
    for i in range(3):  # ... and serves meanwhile with pd-1
        assert stack.chat(image_message(f"while pd-0 is down #{i}", BLUE), max_tokens=4).choices
    after = wait_for(
        lambda: (
            (s := n1.show(unit, "MainPID", "NRestarts", "ActiveState"))["ActiveState"] == "active"
            and s["MainPID"] not in ("0", before["MainPID"])
            and s
        ),
        timeout=90,
        what=f"systemd to restart {unit}",
    )
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    assert n1.run(f"journalctl -q --no-pager -u {unit} | grep -c 'status=9/KILL'").stdout.strip() == "1"
    stack.wait_engine_health("epd-pd-0", True, timeout=60)  # readmitted
    for i in range(6):
        assert stack.chat(image_message(f"after kill -9 #{i}", RED), max_tokens=4).choices


def test_each_configuration_compiled_once_into_the_kits_cache(one_host_stack):
    """Every start so far (deploy, stop/start, kill -9) went through the plugin's cache root under
    the kit's directory: the two PDs share a configuration, so the host compiled two graphs (PD,
    VE) once each, and every later start was a local hit (docs/sim.md "Compile cache")."""
    n1 = one_host_stack.hosts["n1"]
    local = "/var/cache/epd/neuron-compile-cache/neuron/compile_cache"
    keys = n1.run(f"find {local} -mindepth 1 -maxdepth 1 -type d -user epd -name '????????????????????????????????'")
    assert len(keys.stdout.split()) == 2, keys.stdout
    log = n1.run("journalctl -q --no-pager -o cat -u 'epd-engine@*'").stdout
    assert log.count("Compile cache miss: compiling graph") <= 2, log[-3000:]  # at most once per key
    assert log.count("Compilation finished. Graph") >= 4  # 3 engines + the kill -9 restart
    assert "Compile cache hit (local" in log


def test_restart_prints_each_engines_progress_and_the_slowest(one_host_stack):
    """With the compile cache cleared (as after an SDK upgrade), every engine of the restart
    compiles for EPD_SIM_COMPILE_S, and restart.yml prints each engine's phases as they happen."""
    n1 = one_host_stack.hosts["n1"]
    n1.run(f"find {LOCAL_COMPILE_CACHE} -mindepth 1 -maxdepth 1 -exec rm -rf {{}} +")
    start = time.monotonic()
    result = ansible_playbook(one_host_stack.inventory.directory, "playbooks/restart.yml", "-e", "component=engines")
    assert result.returncode == 0, result.describe()
    assert time.monotonic() - start >= float(COMPILE_S)
    for instance in ("pd-0", "pd-1", "ve-0"):
        assert f"[n1] {instance}: compiling" in result.stdout, result.stdout[-4000:]
        assert f"[n1] {instance}: ready" in result.stdout, result.stdout[-4000:]
    assert "slowest: " in result.stdout, result.stdout[-4000:]
    one_host_stack.wait_ready(timeout=60)


class NewImageLoad(LoadGenerator):
    """The bounded load generator, each request with an image never sent before (a VE cache miss),
    at Poisson arrivals: evenly spaced requests never queue in front of a VE that serves faster
    than the spacing, whatever its busy fraction."""

    @property
    def interval(self) -> float:
        return self._rng.expovariate(1 / self._mean_interval)

    @interval.setter
    def interval(self, value: float) -> None:
        self._mean_interval = value
        self._rng = random.Random(22)

    def __init__(self, *args, first_image: int = 0, **kwargs) -> None:
        # images of this generator's own from `first_image` on (each generator's n starts at 0:
        # the same images again would be VE cache hits)
        self.first_image = first_image
        super().__init__(*args, **kwargs)

    def body(self, n: int) -> dict:
        return new_image_body(self.model, self.first_image + n)


def new_image_body(model: str, n: int) -> dict:
    """A chat with the n-th IMAGE_EDGE-square image (n < 65536 distinct ones)."""
    return {
        "model": model,
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": image_data_url((n % 256, n // 256 % 256, 77), IMAGE_EDGE)},
                    },
                    {"type": "text", "text": f"request {n}: what is in the picture?"},
                ],
            }
        ],
    }


@pytest.fixture(scope="module")
def seen() -> dict:
    """What earlier tests of this module measured."""
    return {}


def advise(stack: Stack, window_s: float) -> dict:
    env = dict(os.environ, PATH=f"{REPO / '.venv/bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    argv = [str(REPO / ".venv/bin/epd-router"), "advise", "--url", stack.router_url, "--window", str(window_s)]
    argv += ["--inventory", str(stack.inventory.directory), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=window_s + scaled(120), env=env, check=False)
    assert done.returncode == 0, done.stderr
    print(done.stdout)  # the whole report beside a failure (an assertion's message is cut short)
    return json.loads(done.stdout)


def router_scrape(stack: Stack):
    with stack.http(10) as client:
        reply = client.get("/metrics")
        reply.raise_for_status()
    return parse_text(reply.text, f"{stack.router_url}/metrics")


def measured_load(stack: Stack, first_image: int) -> tuple[float, float]:
    """(the VE's mean encode time per new image with nothing queued, the rate that keeps one VE
    LOAD_BUSY busy): PROBE_REQUESTS new images one after another, the router's encode histogram
    (what the advisor reads) before and after."""
    before, start = router_scrape(stack), time.monotonic()
    with stack.http(60) as client:
        for n in range(PROBE_REQUESTS):
            reply = client.post("/v1/chat/completions", json=new_image_body(stack.model_id(), first_image + n))
            assert reply.status_code == 200, reply.text[:500]
    window = Window(before, router_scrape(stack), max(time.monotonic() - start, 0.001))
    encode = window.histogram("epd_router_encode_seconds")
    assert encode.count == PROBE_REQUESTS and encode.mean, (encode, "every probe request encodes once")
    rate = LOAD_BUSY / encode.mean
    assert rate <= MAX_RATE_PER_S, (
        f"a new {IMAGE_EDGE}px image encodes in {encode.mean:.3f} s: {rate:.1f} requests/s would be needed to keep "
        f"one VE {LOAD_BUSY:.0%} busy, past the {MAX_RATE_PER_S}/s the load generator sends here; raise "
        "ENCODE_MS_PER_1K_PATCHES"
    )
    return encode.mean, rate


def advise_under_load(stack: Stack, rate_per_s: float, first_image: int) -> dict:
    """The advisor's report of a window of Poisson load at `rate_per_s`, long enough for
    WINDOW_REQUESTS; no request may fail."""
    window_s = max(WINDOW_S, round(WINDOW_REQUESTS / rate_per_s))
    limit_s = window_s + 30
    with NewImageLoad(
        stack.router_url, stack.model_id(), rate_per_s=rate_per_s, max_requests=int(rate_per_s * limit_s) + 1,
        max_seconds=limit_s, first_image=first_image,
    ) as load:  # fmt: skip
        load.answered()  # the load is flowing: the window sees it steady
        doc = advise(stack, window_s)
        outcome = load.stop()
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    return doc


def calibrated_advice(stack: Stack, rate_per_s: float, first_image: int) -> tuple[dict, float, int]:
    """The advisor's report of a window whose one VE is in BUSY_BAND, and that window's rate:
    `rate_per_s` first, then scaled by LOAD_BUSY / the busy each window measured (at most
    MAX_RATE_PER_S), up to CALIBRATION_WINDOWS windows, each of new images; the last window's
    report when none lands in the band (the test's assertions then say what it measured); and
    how many windows it took."""
    for window in range(CALIBRATION_WINDOWS):
        doc = advise_under_load(stack, rate_per_s, first_image=first_image + window * 5_000)
        busy = doc["pools"]["ve"]["busy"]
        rescaled = min(MAX_RATE_PER_S, rate_per_s * LOAD_BUSY / max(busy, 0.05))
        if BUSY_BAND[0] <= busy <= BUSY_BAND[1] or rescaled == rate_per_s:
            break
        rate_per_s = rescaled
    return doc, rate_per_s, window + 1


def test_image_heavy_load_on_one_ve_names_the_ve_pool_and_recommends_a_second_ve(one_host_stack, seen, record_timing):
    encode_s, rate = measured_load(one_host_stack, first_image=60_000)
    record_timing("advisor: VE encode per new image, nothing queued", encode_s)
    doc, rate, windows = calibrated_advice(one_host_stack, rate, first_image=0)
    low, high = (round(100 * edge) for edge in BUSY_BAND)
    record_timing(f"advisor: windows taken to put one VE in {low}-{high} % busy", windows, "windows")
    seen["rate"] = rate  # the steps after this one load the fleet the same
    record_timing("advisor: load (requests/s, one VE ~80% busy)", rate, "requests/s")
    record_timing("advisor: 1E2PD VE busy", 100 * doc["pools"]["ve"]["busy"], "%")
    seen["before"] = doc
    record_timing("advisor: 1E2PD TTFT p50 (router)", doc["ttft_p50_s"])
    record_timing("advisor: 1E2PD TTFT p99 (router)", doc["ttft_p99_s"])
    assert doc["enough_traffic"], doc["confidence"]
    assert doc["bottleneck"] == "ve", doc["verdict"]
    rec = doc["recommendation"]
    assert rec["changed"] and rec["action"] == "change", doc
    assert rec["proposed"] == {"n1": [2, 2]}  # the 4 spare cores; a PD pool of 2 keeps its floor
    assert rec["inventory_change"] == ["n1: epd_num_ve 1 -> 2, epd_num_pd 2 -> 2"]


def test_the_recommendation_deploys_under_load_without_a_failed_request(one_host_stack, seen, record_timing):
    assert seen.get("before"), "needs the first test's recommendation"
    fleet_dir = one_host_stack.inventory.directory
    hosts_yml = yaml.safe_load((fleet_dir / "hosts.yml").read_text())
    hosts_yml["all"]["children"]["epd_engines"]["hosts"]["n1"]["epd_num_ve"] = 2
    (fleet_dir / "hosts.yml").write_text(yaml.safe_dump(hosts_yml, sort_keys=False))
    rate = seen["rate"]
    with NewImageLoad(
        one_host_stack.router_url,
        one_host_stack.model_id(),
        rate_per_s=rate,
        max_requests=int(rate * STEP_LIMIT_S),
        max_seconds=STEP_LIMIT_S,
        first_image=20_000,
    ) as load:
        load.answered()
        start = time.monotonic()
        result = ansible_playbook(fleet_dir, "playbooks/deploy.yml", timeout=STEP_LIMIT_S)
        record_timing("advisor: deploy of the recommendation under load", time.monotonic() - start)
        load.answered()
        outcome = load.stop()
    assert result.returncode == 0, result.describe()
    assert outcome.ok == outcome.sent, (f"{len(outcome.failures)} of {outcome.sent} failed", outcome.failures[:10])
    ves = [e for e in one_host_stack.pools() if e["id"].startswith("epd-ve-")]
    assert len(ves) == 2 and all(is_healthy(e) and e["state"] == "active" for e in ves), ves


def test_after_the_change_encode_time_falls_and_no_change_is_recommended(one_host_stack, seen, record_timing):
    before = seen.get("before")
    assert before, "needs the first test's figures"
    doc = advise_under_load(one_host_stack, seen["rate"], first_image=40_000)  # the same load, new images
    record_timing("advisor: 2E2PD TTFT p50 (router)", doc["ttft_p50_s"])
    record_timing("advisor: 2E2PD TTFT p99 (router)", doc["ttft_p99_s"])
    assert doc["pools"]["ve"]["engines"] == 2
    # the predicted direction: queueing in front of the VE pool shrinks (the bench measures the size)
    assert doc["pools"]["ve"]["time_in_stage_s"] < 0.8 * before["pools"]["ve"]["time_in_stage_s"], (before, doc)
    assert doc["pools"]["ve"]["busy"] < before["pools"]["ve"]["busy"]
    # TTFT falls in the mean, the figure the advisor predicts (recommendation.predicted_ttft_mean_s):
    # what the second VE removes is queueing, which the mean and the tail carry, not the median (at
    # ~80 % busy most requests find the VE free). The median rose 0.324 -> 0.332 s in the loaded run
    # of afc6af1 (load ~20) while the VE's time in stage fell: the second VE process slows every
    # stage's service a little on 2 shared cores
    mean_before, mean_after = before["recommendation"]["ttft_mean_s"], doc["recommendation"]["ttft_mean_s"]
    record_timing("advisor: 1E2PD TTFT mean (router)", mean_before)
    record_timing("advisor: 2E2PD TTFT mean (router)", mean_after)
    assert mean_after < mean_before, (before, doc)
    assert doc["recommendation"] is not None and doc["recommendation"]["action"] == "none", doc


def test_an_idle_window_is_too_little_traffic(one_host_stack):
    doc = advise(one_host_stack, 3)
    assert not doc["enough_traffic"]
    assert doc["recommendation"] is None
    assert "too little traffic" in doc["confidence"]


def test_check_mode_changes_nothing(one_host_stack, record_timing):
    """A second deploy in check mode predicts no change on a host that runs the engines and the
    router side by side (the targets both roles write among them). That a real second deploy
    changes nothing is test_day2's last step, on four hosts after every day-2 change."""
    n1 = one_host_stack.hosts["n1"]
    before = kit_state(n1)
    start = time.monotonic()
    result = ansible_playbook(one_host_stack.inventory.directory, "playbooks/deploy.yml", "--check", "--diff")
    record_timing("1 host: re-deploy in check mode (--check --diff)", time.monotonic() - start)
    assert result.returncode == 0, result.describe()
    assert result.recap["n1"]["changed"] == 0, result.describe()
    assert kit_state(n1) == before


def test_without_the_operators_collector_the_fleet_exports_to_its_store(one_host_stack, otlp, record_timing):
    """A re-deploy without the operator's collector (epd_otlp_traces_endpoint): the fleet's default is
    then its trace store, Phoenix on n1, installed there by default by the first deploy
    (plan/trace_store.py: n1 is the monitoring host the kit reaches over SSH). Every engine runs with
    vLLM's flag naming the store's OTLP/HTTP ingest; a client's traced image chat is found in the
    store by its trace id through Phoenix's REST API (GET /v1/projects/{project}/spans?trace_id=...,
    the `default` project of spans without one: phoenix/server/api/routers/v1/spans.py,
    arize-phoenix 20.26.1), with the router's request span under the client's span, its `ve encode`
    and `pd generate` under that and the VE's and the PD's `llm_request` each under the call that
    carried its traceparent; the receiver, the collector before, gets nothing from any process.
    Phoenix's footprint on n1 (its unit's memory, its venv and database on disk) is recorded."""
    fleet_dir = one_host_stack.inventory.directory
    (fleet_dir / TRACES_FILE).unlink()
    start = time.monotonic()
    result = ansible_playbook(fleet_dir, "playbooks/deploy.yml", timeout=STEP_LIMIT_S)
    record_timing("1 host: re-deploy, traces to the store (the engines roll)", time.monotonic() - start)
    assert result.returncode == 0, result.describe()
    n1 = one_host_stack.hosts["n1"]
    store = f"http://{machine_address(1)}:6006"
    assert n1.is_active("epd-trace-store.service") == "active"
    # its storage: the store's user only (0750); the unit binds the host's address, not 0.0.0.0
    assert n1.run("stat -c '%U %a' /var/lib/epd-phoenix").stdout.split() == ["epd-phoenix", "750"]
    assert n1.run("getent passwd epd-phoenix | cut -d: -f7").stdout.strip() == "/usr/sbin/nologin"
    engines = {e["id"]: e for e in one_host_stack.pools()}
    units = [f"epd-engine@{engine_id.removeprefix('epd-')}.service" for engine_id in engines]
    assert any("ve-" in u for u in units) and any("pd-" in u for u in units), units
    pids = {}
    for unit in units:
        pids[unit], argv, environ = n1.main_process(unit)
        assert argv[argv.index("--otlp-traces-endpoint") + 1] == f"{store}/v1/traces", (unit, argv)
        assert environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") == "http/protobuf", environ
    posts = otlp.posts
    trace_id, client_span, header = client_traceparent()
    reply = one_host_stack.chat(
        image_message("What is in the picture? (traced to the store)", BLUE),
        max_tokens=4,
        extra_headers={"traceparent": header},
    )
    assert reply.choices[0].message.content is not None
    wanted = sorted([REQUEST_SPAN, "receive", "render", "ve encode", "pd generate", "llm_request", "llm_request"])

    def stored() -> list[dict] | None:
        answer = httpx.get(
            f"{store}/v1/projects/default/spans", params={"trace_id": trace_id}, timeout=5, trust_env=False
        )
        spans = answer.json()["data"] if answer.status_code == 200 else []
        return spans if sorted(s["name"] for s in spans) == wanted else None

    spans = wait_for(stored, timeout=30, what=f"trace {trace_id} in the trace store with the spans {wanted}")
    assert {s["context"]["trace_id"] for s in spans} == {trace_id}
    by_name = {s["name"]: s for s in spans if s["name"] != "llm_request"}
    root = by_name[REQUEST_SPAN]
    assert root["parent_id"] == client_span, root
    for name in ("receive", "render", "ve encode", "pd generate"):
        assert by_name[name]["parent_id"] == root["context"]["span_id"], by_name[name]
    calls = {by_name[name]["attributes"]["epd.engine.id"]: by_name[name] for name in ("ve encode", "pd generate")}
    assert {engine_id.split("-")[1] for engine_id in calls} == {"ve", "pd"}, calls
    assert set(calls) <= set(engines), (calls, engines)
    engine_spans = {s["parent_id"]: s for s in spans if s["name"] == "llm_request"}
    for call in calls.values():  # each engine's span: under the call that carried its traceparent
        mine = engine_spans[call["context"]["span_id"]]
        assert mine["attributes"]["gen_ai.request.id"].startswith("generate-tokens-"), mine
    # the receiver, still listening, got nothing more: one collector per fleet
    time.sleep(3)  # 30 times the export delay the traced requests arrived within
    assert otlp.posts == posts and otlp.trace(trace_id) == [], otlp.trace(trace_id)
    # Phoenix's footprint on its host (docs/observability.md "Trace store")
    # resident memory of every process of its unit (the test hosts keep no memory accounting:
    # MemoryCurrent reads "[not set]" there)
    unit = "epd-trace-store.service"
    rss_kib = n1.run(
        f"for p in $(cat /sys/fs/cgroup$(systemctl show -P ControlGroup {unit})/cgroup.procs 2>/dev/null"
        f" || systemctl show -P MainPID {unit}); do awk '/^VmRSS/ {{print $2}}' /proc/$p/status 2>/dev/null"
        " || true; done"
    ).stdout.split()
    assert rss_kib and all(k.isdigit() for k in rss_kib), rss_kib
    venv_kib, db_kib = (
        int(n1.run(f"du -sk {path}").stdout.split()[0]) for path in ("/opt/epd/phoenix", "/var/lib/epd-phoenix")
    )
    record_timing(
        f"1 host: the trace store's resident memory ({len(rss_kib)} processes)", sum(map(int, rss_kib)) / 1024, "MiB"
    )
    record_timing("1 host: the trace store's venv on disk", venv_kib / 1024, "MiB")
    record_timing("1 host: the trace store's database directory on disk", db_kib / 1024, "MiB")


def test_the_host_redeployed_text_only_answers_text_and_refuses_an_image(one_host_stack, record_timing):
    """A text-only fleet (docs/planner.md "Text-only fleets") deployed over this one, as an operator
    would change the inventory: epd_text_only and no VE. The VEs retire, the router reloads with
    `endpoints.text_only` (router.yaml says it, so it accepts no VE), is ready with PDs alone,
    answers a text request and refuses an image with a 400 in OpenAI's error shape."""
    from openai import BadRequestError

    fleet_dir = one_host_stack.inventory.directory
    hosts_yml = yaml.safe_load((fleet_dir / "hosts.yml").read_text())
    hosts_yml["all"]["children"]["epd_engines"]["hosts"]["n1"]["epd_num_ve"] = 0
    (fleet_dir / "hosts.yml").write_text(yaml.safe_dump(hosts_yml, sort_keys=False))
    (fleet_dir / "group_vars/all/text-only.yml").write_text("epd_text_only: true\n")
    start = time.monotonic()
    result = ansible_playbook(fleet_dir, "playbooks/deploy.yml", timeout=STEP_LIMIT_S)
    record_timing("1 host: re-deploy as a text-only fleet (the VEs retire, the PDs roll)", time.monotonic() - start)
    assert result.returncode == 0, result.describe()
    assert sorted(e["id"] for e in one_host_stack.pools()) == ["epd-pd-0", "epd-pd-1"]
    n1 = one_host_stack.hosts["n1"]
    assert {n1.is_active(f"epd-engine@ve-{i}.service") for i in (0, 1)} == {"inactive"}  # the advisor's two
    ready = httpx.get(f"{one_host_stack.router_url}/ready", timeout=5, trust_env=False)
    assert ready.status_code == 200 and ready.json() == {"ready": True}, ready.text
    text = one_host_stack.chat([{"role": "user", "content": "Say hello to the sandbox."}], max_tokens=8)
    assert text.choices[0].message.content and text.usage.completion_tokens <= 8
    with pytest.raises(BadRequestError) as refused:
        one_host_stack.chat(image_message("What is in the picture?", RED), max_tokens=8)
    assert refused.value.status_code == 400
    assert refused.value.body == {
        "message": "this fleet is text-only: it has no encoder (VE) for images; send text only",
        "type": "invalid_request_error",
        "param": "messages[0].content[0]",
        "code": 400,
    }


def test_teardown_leaves_the_host_clean(one_host_stack):
    n1 = one_host_stack.hosts["n1"]
    cache = "/var/cache/epd/neuron-compile-cache"
    n1.run(f"mkdir -p {cache}/m && echo neff > {cache}/m/model.neff")
    result = ansible_playbook(one_host_stack.inventory.directory, "playbooks/teardown.yml")
    assert result.returncode == 0, result.describe()
    # the compile cache outlives a teardown (the next deploy would cold-compile) ...
    assert n1.run("ls -A /var/cache/epd").stdout.split() == ["neuron-compile-cache"]
    assert n1.run(f"cat {cache}/m/model.neff").stdout.strip() == "neff"
    # ... unless purged
    result = ansible_playbook(
        one_host_stack.inventory.directory, "playbooks/teardown.yml", "-e", "epd_teardown_purge_cache=true"
    )
    assert result.returncode == 0, result.describe()
    assert n1.units("epd*") == [], n1.units("epd*")
    leftovers = n1.run(
        "ls -d /etc/epd /var/cache/epd /etc/systemd/system/epd* "
        "/etc/systemd/system/*.wants/epd* 2>/dev/null; getent passwd epd; getent group epd; true"
    ).stdout
    assert leftovers.strip() == "", f"teardown left: {leftovers}"
    assert n1.run("pgrep -f 'epd-(sim|router)'", check=False).returncode != 0
    # the kit's access rules went with it (its table, file and unit)
    assert n1.run("nft list table inet epd_kit", check=False).returncode != 0
    assert not n1.path("/etc/nftables.d/epd-kit.nft").exists()
    assert (
        n1.run("test -e /models/tiny-qwen3-vl/config.json", check=False).returncode == 0
    )  # never the operator's model
