"""The fleet's trace store: which monitoring host runs one, where it listens, and the traces URL
the router and the engines export to when the operator names no collector.

A fleet with a monitoring host keeps its traces by default: `epd_trace_store` (on each host of
epd_monitoring) is `auto` unless set, and the store, Arize Phoenix (roles/epd_observability,
docs/observability.md "Trace store"), runs on

- the first monitoring host (inventory order) with `epd_trace_store: phoenix`, else
- the first with `auto` that the kit reaches over SSH (not `ansible_connection: local`: the
  operator's own machine gets no service it did not ask for) and that has an address the fleet's
  hosts see; a monitoring host without one is passed over, not refused (it asked for nothing).

With `epd_otlp_traces_endpoint` unset, the fleet exports to the store's OTLP/HTTP ingest,
`http://<its address>:<epd_trace_store_port>/v1/traces` (Phoenix serves OTLP/HTTP on its HTTP
port at /v1/traces: phoenix/server/api/routers/v1/traces.py, `post_traces`, arize-phoenix 20.26.1).
An operator's own collector always wins; `none` on a monitoring host deploys nothing there, so
`none` on every one (or no monitoring host) leaves tracing off, and the endpoint never names a
store that is not deployed.

Stdlib only, like the rest of epd_kit.plan.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .values import plain
from .variables import MONITORING, VARIABLES

ENDPOINT = "epd_otlp_traces_endpoint"


@dataclass(frozen=True)
class TraceStore:
    """The monitoring host that runs the store and where it listens (address None: it has none
    the other hosts see, a problem `store_problems` reports)."""

    host: str
    address: str | None
    port: int
    grpc_port: int

    @property
    def url(self) -> str:
        """The store's base URL (UI and REST API); "" without an address."""
        if self.address is None:
            return ""
        shown = f"[{self.address}]" if ipaddress.ip_address(self.address).version == 6 else self.address
        return f"http://{shown}:{self.port}"

    @property
    def traces_endpoint(self) -> str:
        return f"{self.url}/v1/traces" if self.url else ""


def host_address(host: str, variables: Mapping[str, Any]) -> str | None:
    """The address peers see `host` at: epd_bind_address, else ansible_host, when it is an IP address
    that is neither loopback nor a wildcard (plan/firewall.py lets every peer in by it)."""
    for key in ("epd_bind_address", "ansible_host"):
        value = plain(variables[key]) if key in variables else None
        try:
            address = ipaddress.ip_address(str(value).strip().strip("[]"))
        except ValueError:
            continue
        if not address.is_loopback and not address.is_unspecified:
            return str(address)
    return None


def _value(variables: Mapping[str, Any], name: str) -> Any:
    value = plain(variables[name]) if name in variables else None
    return VARIABLES[name].default if value is None else value


def _store(host: str, variables: Mapping[str, Any]) -> TraceStore:
    return TraceStore(
        host,
        host_address(host, variables),
        int(_value(variables, "epd_trace_store_port")),
        int(_value(variables, "epd_trace_store_grpc_port")),
    )


def _by_default(host: str, variables: Mapping[str, Any]) -> bool:
    """`auto` picks this monitoring host: reached over SSH and seen by the fleet at an address."""
    connection = plain(variables["ansible_connection"]) if "ansible_connection" in variables else None
    return str(connection or "ssh") != "local" and host_address(host, variables) is not None


def trace_store(hostvars: Mapping[str, Any], groups: Mapping[str, Any]) -> TraceStore | None:
    """The first monitoring host with `epd_trace_store: phoenix`, else the first `auto` one the
    default picks (`_by_default`), or None."""
    chosen: TraceStore | None = None
    for host in map(str, groups.get(MONITORING) or []):
        variables = hostvars[host] if host in hostvars else {}  # noqa: SIM401  (.get templates all of them)
        wanted = str(_value(variables, "epd_trace_store"))
        if wanted == "phoenix":
            return _store(host, variables)
        if wanted == "auto" and chosen is None and _by_default(host, variables):
            chosen = _store(host, variables)
    return chosen


def store_problems(hostvars: Mapping[str, Any], groups: Mapping[str, Any]) -> list[str]:
    """A store the fleet's hosts could not reach: its host has no address they see."""
    store = trace_store(hostvars, groups)
    if store is None or store.address is not None:
        return []
    return [
        f"{store.host}: epd_trace_store is phoenix and the engines and routers export their traces to it "
        f"by address, but {store.host} has none they see (epd_bind_address, else ansible_host, as an IP "
        f"address that is not loopback): set epd_bind_address of {store.host} to its private address"
    ]


def traces_summary(hostvars: Mapping[str, Any], groups: Mapping[str, Any], endpoint: str) -> str:
    """plan.yml's line on where the fleet's spans go; `endpoint`: the planned epd_otlp_traces_endpoint
    (the store's when the operator set none)."""
    store = trace_store(hostvars, groups)
    if store is None:
        if endpoint:
            return f"TRACES: to {endpoint} (your collector); no trace store"
        return (
            "TRACES: off: no collector (epd_otlp_traces_endpoint) and no trace store (no monitoring host the "
            "kit reaches over SSH at an address the fleet sees, or epd_trace_store: none on each)"
        )
    where = f"the trace store on {store.host} (Phoenix, {store.url or 'no address: refused above'})"
    if endpoint and endpoint == store.traces_endpoint:
        return f"TRACES: to {where}"
    return f"TRACES: to {endpoint} (your collector); {where} is deployed and gets nothing from the fleet"


class _WithEndpoint(Mapping[str, Any]):
    """One host's variables, plus the store's traces URL as epd_otlp_traces_endpoint."""

    def __init__(self, variables: Mapping[str, Any], endpoint: str) -> None:
        self._variables, self._endpoint = variables, endpoint

    def __getitem__(self, key: str) -> Any:
        return self._endpoint if key == ENDPOINT else self._variables[key]

    def __contains__(self, key: object) -> bool:
        return key == ENDPOINT or key in self._variables

    def __iter__(self) -> Iterator[str]:
        yield from self._variables
        if ENDPOINT not in self._variables:
            yield ENDPOINT

    def __len__(self) -> int:
        return len(self._variables) + (ENDPOINT not in self._variables)


def with_default_endpoint(
    hostvars: Mapping[str, Any], groups: Mapping[str, Any], hosts: Sequence[str]
) -> Mapping[str, Any]:
    """hostvars where each of `hosts` (the engine hosts) that sets no epd_otlp_traces_endpoint reads
    the store's; hostvars itself when there is no store (or it has no address)."""
    store = trace_store(hostvars, groups)
    if store is None or not store.traces_endpoint:
        return hostvars
    unset = {str(h) for h in hosts if not (ENDPOINT in hostvars[str(h)] and plain(hostvars[str(h)][ENDPOINT]))}
    if not unset:
        return hostvars
    return {
        **{str(h): hostvars[str(h)] for h in hostvars},
        **{h: _WithEndpoint(hostvars[h], store.traces_endpoint) for h in unset},
    }
