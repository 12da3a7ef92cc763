"""The router's app object: builds the request path out of its parts and owns the lifecycle.

    intake      intake.IntakeGate            requests preprocessing (after their body), capped
    decode_pool                              threads that decode big request bodies (body.py)
    engines     engine_client.EngineClient   HTTP to the engines, health rules and probes
    encoder     encode.Encoder               VE fan-out, retries, re-encode
    admission   admission.PdAdmission        PD slots and the FIFO wait queue
    generation  generation.Generation        render → encode → PD (one retry loop) → answer
    tracing     tracing.Tracing              the requests' spans (off unless configured)

All of them read the same `RouterState`; `reload` swaps its config and pool snapshot. Each model
of the config's `models` has a lane of its own (lanes.py), and `lanes` holds them all, by served
name; the parts above are the lane of the model listed first (a request without `model` gets it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from epd_kit.router.admin import AdminGate, load_admin_tokens
from epd_kit.router.engine_keys import load_engine_keys
from epd_kit.router.intake import IntakeGate
from epd_kit.router.lanes import Lane, combined_pools, unknown_model
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.pools import build_pools
from epd_kit.router.probes import ServingProbes
from epd_kit.router.rendering import Renderer
from epd_kit.router.tenants import TenantMetrics, Tenants, load_client_keys
from epd_kit.router.tracing import Tracing
from epd_kit.router_yaml import RouterConfig, load_config

T = TypeVar("T")

log = logging.getLogger("epd_router.service")

# settings baked into the listener or the preprocessor at start; a reload keeps the old values
# (`models`: a lane per model is built at start from its name, checkpoint and limits; its
# `endpoints` apply on reload, MODEL_RESTART_ONLY the rest; `limits` is compared as the lane
# reads it, the model's over the top-level section, whichever file shape wrote them)
RESTART_ONLY = ("listen", "limits", "media", "tracing")
MODEL_RESTART_ONLY = ("model", "quantization")


def preprocess_stats(lanes: Mapping[str, Lane]) -> dict[str, Any]:
    """Each model's renderer's cache counters by its served name (the metrics' `model` label). A
    renderer several lanes share (one given for every model, as in tests) is one cache: it counts
    under the first of them."""
    by_renderer: dict[int, tuple[str, Any]] = {}
    for name, lane in lanes.items():
        by_renderer.setdefault(id(lane.renderer), (name, getattr(lane.renderer, "stats", None)))
    return {name: stats for name, stats in by_renderer.values() if stats is not None}


class RouterService:
    def __init__(
        self,
        cfg: RouterConfig,
        renderer: Renderer,
        *,
        config_path: Path | None = None,
        worker: str | None = None,
        lane_renderer: Callable[[RouterConfig], Renderer] | None = None,
    ) -> None:
        """`worker`: this process's name among the host's router processes (the host's shared
        tenant buckets keep one concurrency count per worker). `renderer`: the listed first's;
        `lane_renderer`: each other model's renderer from its lane's config (None: `renderer`
        serves every model, as in tests)."""
        self.config_path = config_path
        self.lanes: dict[str, Lane] = {}
        self.metrics = RouterMetrics(
            lambda: combined_pools(lambda: list(self.lanes.values())), lambda: preprocess_stats(self.lanes)
        )
        self.auth, tenant_keys = load_client_keys(cfg.auth.api_keys_file, cfg.auth.tenants_file)
        self.tenants = Tenants(TenantMetrics(self.metrics.registry), self.metrics.shared_dir, worker)
        self.metrics.family_filters.append(self.tenants.metrics.cap)
        self.tenants.apply(tenant_keys)
        self.intake = IntakeGate()
        self.decode_pool = ThreadPoolExecutor(cfg.limits.text_workers, thread_name_prefix="epd-decode")
        self.admin = AdminGate(cfg.admin.networks, load_admin_tokens(cfg.admin.token_file))
        engine_keys = load_engine_keys(cfg.engine_auth.key_file)
        for position, entry in enumerate(cfg.models):
            lane_cfg = cfg.lane_config(entry.name)
            own = position == 0 or lane_renderer is None  # `renderer` is the listed first's
            lane = Lane.build(entry.name, lane_cfg, renderer if own else lane_renderer(lane_cfg), self.metrics)
            lane.engines.set_keys(engine_keys)
            self.lanes[entry.name] = lane
        # the listed first's lane is the service's own: the routes without a `model` use these
        first = next(iter(self.lanes.values()))
        self.renderer, self.state, self.engines = first.renderer, first.state, first.engines
        self.admission, self.encoder, self.generation = first.admission, first.encoder, first.generation
        self.tracing = Tracing(
            cfg.tracing,
            lambda header: self.metrics.trace_context_errors.labels(header).inc(),
            self.metrics.trace_spans_dropped.inc,
        )
        self.active_requests = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task] = set()

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        for lane in self.lanes.values():
            await lane.engines.start(await ServingProbes.build(lane.renderer))

    async def stop(self) -> None:
        for lane in self.lanes.values():
            await lane.engines.aclose()
        await self.tracing.aclose()
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        renderers = {id(lane.renderer): lane.renderer for lane in self.lanes.values()}
        for renderer in renderers.values():
            aclose = getattr(renderer, "aclose", None)
            if aclose is not None:
                await aclose()

    @property
    def several(self) -> bool:
        """More than one model: requests are routed by their `model`."""
        return len(self.lanes) > 1

    def lane_for(self, model: str | None) -> Lane:
        """The lane of a request's `model`. One model: the one lane, whatever the request names
        (as before). Several: the lane of that served name (or checkpoint); no `model`: the
        first; any other name is OpenAI's 404 model_not_found."""
        lanes = list(self.lanes.values())
        if not self.several or not model:
            return lanes[0]
        lane = self.lanes.get(model)
        if lane is not None:
            return lane
        for lane in lanes:
            if lane.state.cfg.model == model:
                return lane
        raise unknown_model(model, list(self.lanes))

    def reload(self) -> bool:
        """Re-read the config file and apply it atomically; a bad file keeps the old config,
        and so does one that would turn API keys off without saying `auth: {enabled: false}`."""
        if self.config_path is None:
            log.warning("reload requested but the router runs from flags, not a file")
            return False
        try:
            new = load_config(self.config_path)
            auth, tenant_keys = load_client_keys(new.auth.api_keys_file, new.auth.tenants_file)
            # re-read on every reload: a rotation rewrites the files, not router.yaml
            engine_keys = load_engine_keys(new.engine_auth.key_file)
            admin = AdminGate(new.admin.networks, load_admin_tokens(new.admin.token_file))
            if self.auth.enabled and not auth.enabled and new.auth.enabled is not False:
                raise ValueError(
                    "the new file has no auth.api_keys_file or auth.tenants_file: it would turn API-key "
                    "authentication off; set auth: {enabled: false} to do that on purpose"
                )
        except ValueError as exc:
            self.metrics.reloads.labels("error").inc()
            log.error("config reload failed; keeping the running config", extra={"error": str(exc)})
            return False
        if self.auth.enabled and not auth.enabled:
            log.warning("config reload turns API-key authentication off (auth.enabled: false)")
        removed, changed = [], set()
        served = {m.name for m in new.models}
        for position, (name, lane) in enumerate(self.lanes.items()):
            named = name if name in served else None
            if named is None and position == 0:  # the listed first, renamed: still its pools (as the plan's
                named = new.models[0].name  # endpoints-only write: router_config.endpoints_only)
                changed.add(f"models.{name}.name")
            if named is None:
                log.warning(f"config reload: model {name!r} is gone from `models`; it is served until a restart")
                continue
            lane_old, lane_new = lane.state.cfg, new.lane_config(named)
            old_entry, new_entry = lane_old.models[0], lane_new.models[0]
            changed |= {key for key in RESTART_ONLY if getattr(lane_new, key) != getattr(lane_old, key)}
            changed |= {
                f"models.{name}.{k}" for k in MODEL_RESTART_ONLY if getattr(new_entry, k) != getattr(old_entry, k)
            }
            kept = old_entry.model_copy(update={"endpoints": new_entry.endpoints})
            lane_new = lane_new.model_copy(update={**{k: getattr(lane_old, k) for k in RESTART_ONLY}, "models": [kept]})
            lane_pools, lane_removed = build_pools(lane_new, lane.state.pools)
            # one assignment each: a request sees either the old or the new snapshot
            lane.state.cfg = lane_new
            lane.state.pools = lane_pools
            removed += lane_removed
        for key in sorted(changed):
            log.warning(f"config reload: '{key}' changed; it takes effect only on restart")
        for name in served - set(self.lanes) - {new.models[0].name}:
            log.warning(f"config reload: new model {name!r} in `models`; it is served after a restart")
        pools = self.state.pools
        self.auth = auth
        self.tenants.apply(tenant_keys)  # new limits; the buckets keep their levels
        for lane in self.lanes.values():
            lane.engines.set_keys(engine_keys)
        self.admin = admin
        self.metrics.reloads.labels("ok").inc()
        log.info(
            "config reloaded",
            extra={
                "ve": [f"{e.id}:{e.state.value}" for e in pools.ve],
                "pd": [f"{e.id}:{e.state.value}" for e in pools.pd],
                "removed": [e.id for e in removed],
            },
        )
        for lane in self.lanes.values():
            lane.engines.probe_soon()
            task = asyncio.get_running_loop().create_task(lane.admission.pools_changed())
            self._background.add(task)  # the loop keeps only weak references
            task.add_done_callback(self._background.discard)
        return True

    def keep(self, task: asyncio.Task[T]) -> asyncio.Task[T]:
        """Hold a reference to `task` until it ends (the loop keeps only weak ones)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # --- drain -----------------------------------------------------------------------------

    def begin_request(self) -> None:
        self.active_requests += 1
        self._idle.clear()

    def end_request(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self._idle.set()

    def begin_drain(self) -> None:
        """Stop looking ready (/ready says 503, load balancers move on); requests are still
        served."""
        for lane in self.lanes.values():
            lane.state.draining = True

    async def wait_idle(self, grace_s: float) -> bool:
        """Wait up to `grace_s` for the requests in flight; True if none is left."""
        try:
            async with asyncio.timeout(grace_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False
