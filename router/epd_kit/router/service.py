"""The router's app object: builds the request path out of its parts and owns the lifecycle.

    intake      intake.IntakeGate            requests preprocessing (after their body), capped
    decode_pool                              threads that decode big request bodies (body.py)
    engines     engine_client.EngineClient   HTTP to the engines, health rules and probes
    encoder     encode.Encoder               VE fan-out, retries, re-encode
    admission   admission.PdAdmission        PD slots and the FIFO wait queue
    generation  generation.Generation        render → encode → PD (one retry loop) → answer
    tracing     tracing.Tracing              the requests' spans (off unless configured)

All of them read the same `RouterState`; `reload` swaps its config and pool snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from epd_kit.router.admin import AdminGate, load_admin_tokens
from epd_kit.router.admission import PdAdmission
from epd_kit.router.config import RouterConfig, load_config
from epd_kit.router.encode import Encoder
from epd_kit.router.engine_client import EngineClient
from epd_kit.router.engine_keys import load_engine_keys
from epd_kit.router.generation import Generation
from epd_kit.router.intake import IntakeGate
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.pools import build_pools
from epd_kit.router.probes import ServingProbes
from epd_kit.router.rendering import Renderer
from epd_kit.router.state import RouterState
from epd_kit.router.tenants import TenantMetrics, Tenants, load_client_keys
from epd_kit.router.tracing import Tracing

log = logging.getLogger("epd_router.service")

# settings baked into the listener or the preprocessor at start; a reload keeps the old values
RESTART_ONLY = ("model", "served_model_name", "quantization", "listen", "limits", "media", "tracing")


class RouterService:
    def __init__(
        self,
        cfg: RouterConfig,
        renderer: Renderer,
        *,
        config_path: Path | None = None,
        worker: str | None = None,
    ) -> None:
        """`worker`: this process's name among the host's router processes (the host's shared
        tenant buckets keep one concurrency count per worker)."""
        self.config_path = config_path
        self.renderer = renderer
        self.state = RouterState(cfg, build_pools(cfg)[0])
        self.metrics = RouterMetrics(lambda: self.state.pools, lambda: getattr(renderer, "stats", None))
        self.auth, tenant_keys = load_client_keys(cfg.auth.api_keys_file, cfg.auth.tenants_file)
        self.tenants = Tenants(TenantMetrics(self.metrics.registry), self.metrics.shared_dir, worker)
        self.tenants.apply(tenant_keys)
        self.intake = IntakeGate()
        self.decode_pool = ThreadPoolExecutor(cfg.limits.text_workers, thread_name_prefix="epd-decode")
        self.engines = EngineClient(self.state, self.metrics)
        self.engines.set_keys(load_engine_keys(cfg.engine_auth.key_file))
        self.admin = AdminGate(cfg.admin.networks, load_admin_tokens(cfg.admin.token_file))
        self.admission = PdAdmission(self.state, self.metrics)
        self.encoder = Encoder(self.state, self.engines, self.metrics)
        self.generation = Generation(self.state, renderer, self.engines, self.encoder, self.admission, self.metrics)
        self.tracing = Tracing(cfg.tracing)
        self.active_requests = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task] = set()

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.engines.start(await ServingProbes.build(self.renderer))

    async def stop(self) -> None:
        await self.engines.aclose()
        await self.tracing.aclose()
        self.decode_pool.shutdown(wait=False, cancel_futures=True)
        aclose = getattr(self.renderer, "aclose", None)
        if aclose is not None:
            await aclose()

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
        old = self.state.cfg
        for key in RESTART_ONLY:
            if getattr(new, key) != getattr(old, key):
                log.warning(f"config reload: '{key}' changed; it takes effect only on restart")
        pools, removed = build_pools(new, self.state.pools)
        # one assignment each: a request sees either the old or the new snapshot
        self.state.cfg = new.model_copy(update={k: getattr(old, k) for k in RESTART_ONLY})
        self.state.pools = pools
        self.auth = auth
        self.tenants.apply(tenant_keys)  # new limits; the buckets keep their levels
        self.engines.set_keys(engine_keys)
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
        self.engines.probe_soon()
        task = asyncio.get_running_loop().create_task(self.admission.pools_changed())
        self._background.add(task)  # the loop keeps only weak references
        task.add_done_callback(self._background.discard)
        return True

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
        self.state.draining = True

    async def wait_idle(self, grace_s: float) -> bool:
        """Wait up to `grace_s` for the requests in flight; True if none is left."""
        try:
            async with asyncio.timeout(grace_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False
