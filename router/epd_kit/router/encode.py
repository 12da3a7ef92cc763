"""VE encode: every unique item of a request on its HRW VE, all VEs in parallel, a failed VE
call retried on each item's next HRW choice; and the re-encode of items whose locators went bad
before a PD retry. The VE body itself is bodies.py's `ve_body`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from epd_kit.router import upstream
from epd_kit.router.context import RequestContext
from epd_kit.router.errors import EcLoadFailed, EngineDied, RouterError, UpstreamError
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.placement import Item, group_by_ve, place_items
from epd_kit.router.pools import Engine
from epd_kit.router.rendering import PreparedItemLike
from epd_kit.router.state import RouterState
from epd_kit.wire import EcHandoffItem

if TYPE_CHECKING:
    from epd_kit.router.engine_client import EngineClient

log = logging.getLogger("epd_router.encode")


class Encoder:
    def __init__(self, state: RouterState, engines: EngineClient, metrics: RouterMetrics) -> None:
        self._state = state
        self._engines = engines
        self._metrics = metrics
        self._model_metrics = metrics.for_model(state.cfg.model_name)  # this lane's model's series

    async def encode(
        self,
        ctx: RequestContext,
        only: set[str] | None = None,
        avoid: dict[str, set[str]] | None = None,
    ) -> dict[str, EcHandoffItem]:
        """Locators for the request's unique items (or the `only` subset), each on its HRW VE
        (never one in `avoid[mm_hash]`); records which VE encoded each in `ctx.encoded_by`."""
        by_hash: dict[str, PreparedItemLike] = {}
        for item in ctx.items:
            if only is None or item.mm_hash in only:
                by_hash.setdefault(item.mm_hash, item)
        if only is None:
            if len(by_hash) < len(ctx.items):
                self._model_metrics.dedupe.inc(len(ctx.items) - len(by_hash))
            self._model_metrics.items.inc(len(by_hash))
        max_attempts = self._state.cfg.retries.max_attempts
        locators: dict[str, EcHandoffItem] = {}
        tried: dict[str, set[str]] = {h: set() for h in by_hash}
        excluded: dict[str, set[str]] = {h: set((avoid or {}).get(h, ())) for h in by_hash}
        last_error: dict[str, UpstreamError] = {}
        pending = list(by_hash)
        while pending:
            placement = self._state.cfg.placement
            eligible = {e.id: e for e in self._state.pools.eligible_ve()}
            try:
                chosen = place_items(
                    [Item(h, by_hash[h].length) for h in pending],
                    {ve_id: e.inflight_work for ve_id, e in eligible.items()},
                    placement.ve_load_bound,
                    exclude=excluded,
                    slack_items=placement.ve_load_slack_items,
                )
            except LookupError as exc:  # an item has no VE left to try
                h = exc.args[0]
                if h in last_error:
                    raise last_error[h] from None
                self._model_metrics.rejected("no_ve")
                reason = self._state.not_ready_reason() if not eligible else "no VE left to try"
                raise RouterError(
                    503, f"cannot encode images: {reason}", retry_after=self._state.retry_after_s()
                ) from None
            groups = group_by_ve(chosen)
            results = await self._encode_groups(ctx, eligible, groups, by_hash)
            pending = []
            for (ve, hashes), result in zip(groups.items(), results, strict=True):
                if isinstance(result, UpstreamError):
                    for h in hashes:
                        tried[h].add(ve)
                        excluded[h].add(ve)
                        last_error[h] = result
                        if not result.retry_other or len(tried[h]) >= max_attempts:
                            raise result
                        pending.append(h)
                    self._model_metrics.retried("encode")
                    log.warning(
                        "encode failed, retrying on next HRW choice",
                        extra={"request_id": ctx.request_id, "engine": ve, "error": result.message},
                    )
                elif isinstance(result, BaseException):
                    raise result
                else:
                    locators.update(result)
                    for h in hashes:
                        ctx.encoded_by[h] = ve
        return locators

    async def _encode_groups(
        self,
        ctx: RequestContext,
        eligible: dict[str, Engine],
        groups: dict[str, list[str]],
        by_hash: dict[str, PreparedItemLike],
    ) -> list[dict[str, EcHandoffItem] | BaseException]:
        """One POST per VE, all at once; each result is locators or the exception.

        A VE that answered stays counted in `inflight` until the request ends
        (`RequestContext.hold_encoder`): the PD reads the blocks after the encode returns, and
        a drain that stopped the VE at that moment would kill the PD's engine core with an
        `ECLoadFailure` (docs/contract.md §3.5). Its encode work leaves `inflight_work` at once."""
        work = {ve: sum(by_hash[h].length for h in hashes) for ve, hashes in groups.items()}
        for ve in groups:  # reserve in the same step as the choice (reload/drain see it)
            eligible[ve].inflight += 1
            eligible[ve].inflight_work += work[ve]
        results: list[dict[str, EcHandoffItem] | BaseException] = []
        try:
            results = await asyncio.gather(
                *(
                    self._engines.encode(eligible[ve], [by_hash[h] for h in hashes], ctx.engine_request_id)
                    for ve, hashes in groups.items()
                ),
                return_exceptions=True,
            )
            return results
        finally:
            # `results` is empty when the gather was cancelled: nothing answered
            answered = {ve for ve, r in zip(groups, results, strict=False) if not isinstance(r, BaseException)}
            for ve in groups:
                engine = eligible[ve]
                engine.inflight_work -= work[ve]
                if ve not in answered or not ctx.hold_encoder(engine):
                    engine.inflight -= 1

    def charge_unreadable(self, ctx: RequestContext, err: EcLoadFailed | EngineDied) -> list[Engine]:
        """A PD could not read this request's blocks (or its engine core died with them to
        read): charge the VEs that encoded the items it names (all the request's VEs when it
        names none it can be matched to, as a real PD's EngineDeadError never does) and take
        them out of service (`Engine.blocks_unreadable`). Returns the VEs charged."""
        named = {ve for h, ve in ctx.encoded_by.items() if h[:16] in err.engine_text}
        suspects = named or set(ctx.encoded_by.values())
        died = isinstance(err, EngineDied)
        charged = []
        for engine in self._state.pools.ve:
            if engine.id in suspects and not engine.quarantined:
                self._engines.failed(upstream.blocks_unreadable(engine, err.engine_id, engine_died=died), engine)
                # The last VE in service is charged but stays: a read can also fail for a cause
                # that is not the VE's (a timeout on a loaded PD or network), and taking every
                # VE out would fail every image request for a whole quarantine.
                if not any(ve.eligible for ve in self._state.pools.ve if ve is not engine):
                    log.warning(
                        "VE not quarantined: the last VE in service (a PD could not read its blocks)",
                        extra={"request_id": ctx.request_id, "engine": engine.id, "pd": err.engine_id},
                    )
                    continue
                seconds = engine.blocks_unreadable(f"PD {err.engine_id} could not read its blocks")
                self._metrics.engine_quarantines.labels(engine.id).inc()
                log.warning(
                    "VE quarantined: a PD could not read its blocks",
                    extra={"request_id": ctx.request_id, "engine": engine.id, "pd": err.engine_id, "seconds": seconds},
                )
                charged.append(engine)
        return charged

    def reads_succeeded(self, ctx: RequestContext) -> None:
        """A PD read every block of this request (its answer or first stream event came)."""
        if ctx.encoders_held:
            now = time.monotonic()
            for engine in ctx.encoders_held.values():
                if engine.id in ctx.encoded_by.values():
                    engine.reads_ok_at = now

    def unproven(self, ctx: RequestContext) -> list[str]:
        """The VEs of the request's current locators that no PD has read from since they
        came (back) into service."""
        pools = {e.id: e for e in self._state.pools.ve}
        return sorted(ve for ve in set(ctx.encoded_by.values()) if ve not in pools or not pools[ve].reads_proven)

    def quarantined(self, ctx: RequestContext) -> set[str]:
        """Items whose blocks sit on a VE that was quarantined after the encode: no PD must
        be sent to read them (each read would fail and kill that PD's engine core)."""
        if not ctx.encoded_by:
            return set()
        out = set()
        for engine in ctx.encoders_held.values():
            if engine.quarantined:
                out.update(h for h, ve in ctx.encoded_by.items() if ve == engine.id)
        return out

    async def reencode(self, ctx: RequestContext, stale: set[str], gone: set[str]) -> None:
        """New locators for `stale` items, never on a VE in `gone`."""
        avoid = {h: {ctx.encoded_by[h]} for h in stale if ctx.encoded_by.get(h) in gone}
        log.warning(
            "re-encoding items before retrying on another PD",
            extra={"request_id": ctx.request_id, "items": len(stale)},
        )
        async with ctx.time_limit("re-encode"):
            ctx.locators.update(await self.encode(ctx, only=stale, avoid=avoid))

    async def refresh_locators(self, ctx: RequestContext, *, reencode_all: bool, elsewhere: bool = False) -> bool:
        """Before retrying a failed PD call elsewhere: re-encode the items whose VE is gone
        or quarantined (probed now), or all of them if the PD may not have read the
        embeddings (`reencode_all`: its ECLoadFailure, or its engine core's death, generation.py);
        a failed EC read kills a PD engine core (§3.5), so the retry must not read the same
        locators, nor any block of a VE a PD could not read. Returns True if any locator
        changed. `elsewhere`: the items' own VEs may be the cause (an upstream PD's generation
        error, generation.py), so each item goes to another VE where there is one."""
        if not ctx.items:
            return False
        encoders = {e.id: e for e in self._state.pools.ve if e.id in set(ctx.encoded_by.values())}
        await asyncio.gather(*(self._engines.check(e) for e in encoders.values()))
        gone = {ve for ve in set(ctx.encoded_by.values()) if ve not in encoders or not encoders[ve].eligible}
        if elsewhere:
            eligible = {e.id for e in self._state.pools.eligible_ve()}
            gone |= {ve for ve in set(ctx.encoded_by.values()) if eligible - {ve}}
        stale = {h for h, ve in ctx.encoded_by.items() if ve in gone}
        if reencode_all:
            stale = set(ctx.encoded_by)
        if not stale:
            return False
        await self.reencode(ctx, stale, gone)
        return True
