"""The router's configuration: the YAML file Ansible renders (docs/architecture.md "Router
config file", docs/router.md "Several models") and the reference router's flags (docs/contract.md
§1.1), both into one typed model.

A bottom module: the router (router/) and the planner's inventory check (plan/router_check.py)
both import it, and it imports neither the router's runtime nor the planner's logic (only the
plan's constants in plan/models.py and plan/variables.py), so the planner checks the router's
settings by the router's own rules without importing the router (tests/unit/test_import_graph.py).

Every model is one entry of `models` (its name, checkpoint, limits, endpoints); a file in the
shape of the release before (one model at the top level, the others' pools under
`endpoints.models`) loads the same (models_as_list). Unknown keys are errors (a typo must not
silently fall back to a default). Every validation error names the offending key path (as the
file spells it) so `epd-router check-config` output is actionable. The
`limits` and `media` sections are the preprocessor's own settings model (one schema for both).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

# relative, as along the whole chain below: the collection's filters load this package under a
# private name on a controller without the kit (plugins/filter/epd_kit.py BUNDLED_NAME)
from .plan.models import reserved_name
from .plan.router_shape import Loc, models_as_list, served_twice
from .plan.variables import ROUTER_PORT
from .preprocess.model_files import ENGINE_DTYPES
from .preprocess.settings import Limits, Media, Section
from .wire import EC_LOCATOR, HandoffKind


class ListenTls(Section):
    """The listener serves HTTPS only (docs/router.md "TLS"): a PEM certificate chain (leaf
    first) and its key; `key` unset when the key is in the certificate file. A reload (SIGHUP)
    re-reads both files; new paths take a restart."""

    certificate: Path
    key: Path | None = None


class Listen(Section):
    """The client-facing listener (restart only). The client timeouts and the connection cap
    protect it from slow and idle clients (listener.py); the defaults suit a load balancer in
    front (whose idle timeout, often 60 s, must be below `idle_timeout_s`) and direct clients."""

    host: str = "127.0.0.1"
    port: int = Field(default=ROUTER_PORT, ge=0, lt=65536)  # epd_router_port's default
    max_connections: int = Field(default=1024, ge=1)
    # from the connection (or the first byte of the next request) to the end of the headers
    header_timeout_s: float = Field(default=10.0, gt=0)
    # from the end of the headers to the end of the body (64 MiB at 1.1 MB/s)
    body_timeout_s: float = Field(default=60.0, gt=0)
    # keep-alive: a connection idle between requests this long is closed
    idle_timeout_s: float = Field(default=75.0, gt=0)
    # accept queue length (listen(2)); under socket activation the queue every router process
    # of the host takes from, which also holds connections while a process restarts
    backlog: int = Field(default=4096, ge=1)
    # HTTPS instead of HTTP on this listener; unset: plain HTTP (HAProxy in front terminates TLS)
    tls: ListenTls | None = None


class Timeouts(Section):
    connect_s: float = Field(default=5.0, gt=0)
    # caps: an encode call; a PD call until its first token
    ve_s: float = Field(default=600.0, gt=0)
    pd_s: float = Field(default=600.0, gt=0)
    # a started stream: the longest silence between two events before the PD is held hung
    # (its streams end with an error naming it, and it counts against the PD). A decoding
    # vLLM sends a token every few tens of ms; 30 s covers preemption and long prefills of
    # others scheduled between its steps.
    stream_gap_s: float = Field(default=30.0, gt=0)
    total_s: float = Field(default=900.0, gt=0)
    # extension: how long SIGTERM waits for in-flight requests before exiting
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # Hung-engine detection: each call's deadline from its own work (deadlines.py), capped by
    # ve_s / pd_s. Encode: base + per 1k embedding tokens in flight on that VE (this call's
    # included). First token: base + per 1k prompt tokens waiting for prefill on that PD.
    # A non-streaming answer adds per_token_s for each of max_tokens.
    encode_base_s: float = Field(default=10.0, gt=0)
    encode_per_1k_tokens_s: float = Field(default=5.0, ge=0)
    first_token_base_s: float = Field(default=15.0, gt=0)
    first_token_per_1k_tokens_s: float = Field(default=2.0, ge=0)
    per_token_s: float = Field(default=0.5, ge=0)


class Health(Section):
    interval_s: float = Field(default=2.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    # consecutive failures (probes or requests) that eject; successes that readmit
    failure_threshold: int = Field(default=2, ge=1)
    success_threshold: int = Field(default=1, ge=1)
    # outlier ejection: this share of failures among an engine's last `ratio_window` requests
    # (once it has seen half of them) also ejects
    failure_ratio: float = Field(default=0.5, gt=0, le=1)
    ratio_window: int = Field(default=20, ge=2)


class Placement(Section):
    # bound 1.15 + 6 items of slack: the pair docs/benchmarks.md §3 measured to keep ≥ 95 % of
    # the ceiling hit rate with max/mean encoder load ≤ 1.25 (placement.py)
    ve_load_bound: float = Field(default=1.15, ge=1.0)
    ve_load_slack_items: float = Field(default=6.0, ge=0.0)
    pd_max_inflight: int = Field(default=64, ge=1)
    queue_size: int = Field(default=256, ge=0)
    queue_timeout_s: float = Field(default=30.0, ge=0)


class Retries(Section):
    max_attempts: int = Field(default=3, ge=1, le=10)


class Auth(Section):
    # None: on when api_keys_file is set. `false` turns authentication off on purpose, which
    # a reload needs to drop the keys of a running router (service.py).
    enabled: bool | None = None
    api_keys_file: Path | None = None
    # keys that belong to tenants, with each tenant's limits (tenants.py; root:epd 0640)
    tenants_file: Path | None = None
    # extension: whether /metrics and /pools need a key when keys are configured
    protect_metrics: bool = True
    protect_pools: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> Auth:
        if self.enabled is True and not self.on:
            raise ValueError("enabled: true needs api_keys_file or tenants_file")
        if self.enabled is False and self.on:
            raise ValueError("enabled: false with an api_keys_file or tenants_file: remove one of them")
        return self

    @property
    def on(self) -> bool:
        return self.api_keys_file is not None or self.tenants_file is not None


class EngineAuth(Section):
    # the engines' API key (their VLLM_API_KEY), root:epd 0640: the key sent on the first line;
    # during a rotation the previous key on the second, tried once on a 401 (engine_keys.py,
    # docs/security.md "Engine keys"). None: no key is sent.
    key_file: Path | None = None


class Admin(Section):
    # who may read /metrics and /pools: TCP peers in these networks (CIDRs) or a request with
    # `Authorization: Bearer <the token in token_file>` (root:epd 0640); anyone else gets 404
    # (admin.py, docs/security.md "Operator endpoints")
    networks: list[str] = Field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    token_file: Path | None = None

    @field_validator("networks")
    @classmethod
    def _cidrs(cls, networks: list[str]) -> list[str]:
        for network in networks:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"{network!r} is not an address or network (CIDR, e.g. 10.0.0.0/24)") from None
        return networks


class Tracing(Section):
    """OpenTelemetry traces of the chat requests (tracing.py, docs/router.md "Tracing"): off
    (None) unless a collector's OTLP/HTTP traces URL is named (restart only). `sample_ratio`:
    the share of requests traced, drawn by the router whatever a client's traceparent says, unless
    `trust_parent_sampled` (for fleets behind a gateway that samples): then a valid client
    traceparent's sampled flag decides, and the draw is for requests without one."""

    otlp_traces_endpoint: str | None = None
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    trust_parent_sampled: bool = False

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _traces_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.path:
            raise ValueError(f"{url!r} is not a collector's OTLP/HTTP traces URL (http://host:4318/v1/traces)")
        return url


class EngineState(str, Enum):  # noqa: UP042 (StrEnum would change str(member))
    active = "active"
    draining = "draining"


class Endpoint(Section):
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    url: str
    state: EngineState = EngineState.active

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"{url!r}: URL must start with http:// or https://")
        if not parts.hostname:
            raise ValueError(f"{url!r}: URL has no host")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{url!r}: bad port ({exc})") from None
        if port is None:
            raise ValueError(f"{url!r}: URL needs an explicit port (engines have no default port)")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"{url!r}: URL must be scheme://host:port with no path or query")
        return f"{parts.scheme}://{parts.netloc}"


class Endpoints(Section):
    """One model's pools. A text-only model (the inventory's epd_text_only, or an epd_models
    entry's text_only; the render writes it from the plan) has no VE in service: it says so here,
    and only then may `ve` be empty (or hold draining VEs). Image requests then get a 400
    (generation.py) and readiness needs a PD only (state.py)."""

    text_only: bool = False
    ve: list[Endpoint] = Field(default_factory=list)
    pd: list[Endpoint] = Field(min_length=1)

    @field_validator("ve")
    @classmethod
    def _ve_matches_text_only(cls, ve: list[Endpoint], info: ValidationInfo) -> list[Endpoint]:
        text_only = info.data.get("text_only", False)
        active = [e.id for e in ve if e.state is EngineState.active]
        # draining VEs are allowed: a deploy that turns a fleet text-only drains them before it
        # stops them (deploy.yml's retire step), with the new text-only file
        if text_only and active:
            raise ValueError(
                f"{', '.join(active)} active with text_only: true: a text-only fleet has no VE in service "
                "(epd_text_only with epd_num_ve 0 in the inventory; a VE on its way out is draining)"
            )
        if not text_only and not ve:
            raise ValueError(
                "empty: list at least one VE, or set endpoints.text_only: true for a fleet that serves text "
                "only (epd_text_only: true in the inventory)"
            )
        return ve


class ModelEntry(Section):
    """One served model (docs/router.md "Several models"): its served name (what a request's
    `model` says), its checkpoint, its own limits over the top-level section, and its pools.
    The name, checkpoint and limits are read at start (restart only); the pools apply on reload."""

    # any name a request may send (the old shape's top-level model was never held to a pattern:
    # without served_model_name its name is the checkpoint's path); the planner holds epd_models' to ID_PART
    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    quantization: str | None = None
    limits: dict[str, Any] = Field(default_factory=dict)
    endpoints: Endpoints

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        why = reserved_name(name)
        if why:
            raise ValueError(f"{why}; choose another name")
        return name


# the vLLM front whose context checks the router repeats (router/context_window.py)
FrontChecks = Literal["vllm-0.24", "vllm-0.32"]
# How a PD's failed read of an item (ECLoadFailure) reaches the router (router.yaml `ec_read_failure`):
# its engine core dies and every call gets vLLM's EngineDeadError (vllm-neuron's NIXL connector,
# docs/contract.md §3.5), or the request alone ends as vLLM's generic generation error, the engine
# living on (the kit's NIXL connector on vLLM 0.24/0.29, engine_plugin nixl_connector.py; upstream's
# on >= 0.30). The planner writes it (plan/settings.py Settings.ec_read_failure).
EcReadFailure = Literal["engine_dies", "generation_error"]
EC_READ_ENGINE_DIES: EcReadFailure = "engine_dies"
EC_READ_GENERATION_ERROR: EcReadFailure = "generation_error"
FRONT_CHECKS_024: FrontChecks = "vllm-0.24"
FRONT_CHECKS_032: FrontChecks = "vllm-0.32"


class RouterConfig(Section):
    # the engines' --dtype: VE pixel_values travel in the dtype it resolves to for the
    # checkpoint ("auto": the checkpoint's own, float32 checkpoints in bfloat16), as vLLM's
    dtype: str = "auto"
    # how the fleet's VEs hand an item's encoder output to a PD (wire.HandoffKind, docs/contract.md
    # "Hand-offs"): vllm-neuron's `ec_locator` (Neuron, vLLM < 0.30; the default, so a file
    # written before the key existed means what it meant) or upstream vLLM >= 0.30's
    # `ec_transfer_params`. One per fleet: every model's lane runs on the same vLLM. The plan
    # writes it from the engines' vLLM (plan/neuron_releases.py handoff_of).
    handoff: HandoffKind = EC_LOCATOR
    # whose front's context checks the router makes before an engine (router/context_window.py):
    # vLLM 0.24/0.29's (the default: a file written before the key existed means what it meant)
    # or 0.32's, which refuse different requests with other messages. One per fleet, as
    # `handoff`; the plan writes it from the engines' vLLM (plan/neuron_releases.py front_checks_of).
    front_checks: FrontChecks = FRONT_CHECKS_024
    # how a PD's failed read reaches the router (EcReadFailure; the default: a file written
    # before the key existed means what it meant). One per fleet, as `handoff`.
    ec_read_failure: EcReadFailure = EC_READ_ENGINE_DIES
    listen: Listen = Field(default_factory=Listen)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    limits: Limits = Field(default_factory=Limits)
    media: Media = Field(default_factory=Media)
    health: Health = Field(default_factory=Health)
    placement: Placement = Field(default_factory=Placement)
    retries: Retries = Field(default_factory=Retries)
    auth: Auth = Field(default_factory=Auth)
    engine_auth: EngineAuth = Field(default_factory=EngineAuth)
    admin: Admin = Field(default_factory=Admin)
    tracing: Tracing = Field(default_factory=Tracing)
    # every model served, each a lane of its own (lanes.py); a request without `model` goes to
    # the one listed first. A lane's config (lane_config) holds its one model.
    models: list[ModelEntry] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _one_list(cls, data: Any) -> Any:
        return models_as_list(data)[0] if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _models(self) -> RouterConfig:
        names: dict[str, int] = {}
        ids: dict[str, str] = {}
        for index, entry in enumerate(self.models):
            if entry.name in names:
                raise ValueError(served_twice(index, entry.name))
            names[entry.name] = index
            try:
                Limits.model_validate({**self.limits.model_dump(), **entry.limits})
            except ValidationError as exc:
                raise ValueError(f"models[{index}] ({entry.name}).limits: {exc.errors()[0]['msg']}") from None
            for role in ("ve", "pd"):
                where, urls = f"models[{index}].endpoints.{role}", set()
                for ep in getattr(entry.endpoints, role):
                    if ep.id in ids:
                        raise ValueError(
                            f"duplicate engine id {ep.id!r} (in {ids[ep.id]} and {where}): ids key "
                            "placement and NIXL handshakes and must be unique across both pools"
                        )
                    ids[ep.id] = where
                    if ep.url in urls:
                        raise ValueError(f"duplicate {where} URL {ep.url!r}")
                    urls.add(ep.url)
        return self

    def lane_config(self, name: str) -> RouterConfig:
        """The config the lane of the model served as `name` runs with: this one with that model
        alone in `models` and its limits over the top-level section."""
        entry = next(m for m in self.models if m.name == name)
        return self.model_copy(
            update={"limits": Limits.model_validate({**self.limits.model_dump(), **entry.limits}), "models": [entry]}
        )

    @field_validator("dtype")
    @classmethod
    def _engine_dtype(cls, dtype: str) -> str:
        if dtype != "auto" and dtype not in ENGINE_DTYPES:
            raise ValueError(f"{dtype!r} is not one of auto, {', '.join(ENGINE_DTYPES)} (vLLM's --dtype)")
        return dtype

    # A lane's model (lane_config: the one in its `models`); on the whole file's config, the
    # model listed first, which serves a request that names none.
    @property
    def model_name(self) -> str:
        return self.models[0].name

    @property
    def model(self) -> str:
        return self.models[0].model

    @property
    def quantization(self) -> str | None:
        return self.models[0].quantization

    @property
    def endpoints(self) -> Endpoints:
        return self.models[0].endpoints


class ConfigError(ValueError):
    """A config that cannot be used; `str()` is the readable list of problems."""


def _file_loc(loc: Loc, renames: list[tuple[Loc, Loc]]) -> Loc:
    for listed, written in renames:
        if loc[: len(listed)] == listed:
            return written + loc[len(listed) :]
    return loc


def _format_validation(exc: ValidationError, source: str, renames: list[tuple[Loc, Loc]]) -> str:
    lines = [f"{source}: {exc.error_count()} problem(s)"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in _file_loc(tuple(err["loc"]), renames)) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (typo? see docs/architecture.md 'Router config file')"
        elif err["type"] == "missing":
            msg = "required key is missing"
        line = f"  {loc}: {msg}"
        if line not in lines:  # an old-shape file's `model` stands for two keys of the list
            lines.append(line)
    return "\n".join(lines)


def parse_config(data: object, source: str = "config") -> RouterConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        _, renames = models_as_list(data)
    except ValueError as exc:
        raise ConfigError(f"{source}: 1 problem(s)\n  (top level): {exc}") from None
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, source, renames)) from None


def load_config(path: str | Path) -> RouterConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))


def parse_host_port(value: str) -> str:
    """Reference endpoint syntax `host:port` (split on the LAST colon) → base URL."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"endpoint {value!r}: expected host:port")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # bare IPv6
    return f"http://{host}:{int(port)}"


def config_from_flags(
    *,
    model: str,
    ve_endpoints: list[str],
    pd_endpoints: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    ve_timeout_s: float = 120.0,
    pd_timeout_s: float = 600.0,
    quantization: str | None = None,
) -> RouterConfig:
    """The reference router's CLI (docs/contract.md §1.1): ids ve-0.. / pd-0.. by position."""
    endpoints = {
        "ve": [{"id": f"ve-{i}", "url": parse_host_port(e)} for i, e in enumerate(ve_endpoints)],
        "pd": [{"id": f"pd-{i}", "url": parse_host_port(e)} for i, e in enumerate(pd_endpoints)],
    }
    data = {
        "models": [{"name": model, "model": model, "quantization": quantization, "endpoints": endpoints}],
        "listen": {"host": host, "port": port},
        "timeouts": {
            "ve_s": ve_timeout_s,
            "pd_s": pd_timeout_s,
            "total_s": max(900.0, ve_timeout_s + pd_timeout_s),
        },
    }
    return parse_config(data, "command line")
