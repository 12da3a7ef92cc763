"""Tenants: which tenant an API key belongs to, and each tenant's limits (requests per second,
concurrent requests, tokens per minute, images per minute), enforced with token buckets that
the router processes of one host share (docs/router.md "Tenants").

The file and its format: epd_kit/plan/tenants_format.py (the planner writes it). The table the
buckets live in: tenant_table.py.

Buckets: `requests_per_s` refills that many a second (burst: one second's worth, at least 1),
one taken per request; `images_per_min` refills per minute, as many taken as the request has
images; `tokens_per_min` refills per minute and is charged from the answer's usage (prompt +
completion) as the answer ends, so it may go below zero (at most what RETRY_AFTER_MAX_S of
refill lifts): a tenant is refused while its level is not above zero, and Retry-After is the
time the refill takes to lift it there (1 to RETRY_AFTER_MAX_S). `concurrent_requests` counts
requests in flight. A refused request is a 429 in OpenAI's shape with that Retry-After; it
costs the tenant nothing.

Sharing: the buckets live in one table of fixed-size slots (the configured tenants' only), in
memory for a single process or in a file under the metrics directory (`PROMETHEUS_MULTIPROC_DIR`,
/run/epd-router) for the processes of a host, each change read and written under an exclusive
`flock` of that file (two per request, only when tenants are configured). Concurrency counts
are kept per worker, so a process that dies leaves no slots behind: its successor (the same
worker name) clears them, and another worker drops them once the process no longer runs.
The file fails safe (docs/router.md "Tenants"): each slot validated on read, a damaged,
foreign, deleted or replaced file repaired or followed, a busy lock waited for at most
LOCK_WAIT_S off the event loop; meanwhile a process answers from its own table.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric

from epd_kit.plan.tenants_format import (
    LIMITS,
    RETRY_AFTER_MAX_S,
    TenantKeys,
    TenantLimits,
    parse_tenants,
)
from epd_kit.router import tenant_table
from epd_kit.router.auth import ApiKeyChecker, KeyFileError, load_api_keys, read_secret_file
from epd_kit.router.errors import RouterError
from epd_kit.router.tenant_table import (
    IPM,
    LOCK_POLL_S,
    LOCK_WAIT_S,
    MAX_WORKERS,
    RPS,
    TABLE_FILE,
    TPM,
    BucketTable,
    Slot,
    TableFault,
)

log = logging.getLogger("epd_router.tenants")

T = TypeVar("T")


def load_tenants_file(path: Path) -> TenantKeys:
    text = read_secret_file(path, "tenants_file", group_readable=True)
    return parse_tenants(text, f"tenants_file {path}")


def _refill(values: list[float], at: int, capacity: float, per_s: float, now: float) -> float:
    """The bucket's level now (a new bucket starts full), stored back into `values`. A debt is
    kept above what the longest Retry-After refills."""
    level, then = values[at], values[at + 1]
    level = capacity if math.isnan(level) else min(capacity, level + max(0.0, now - then) * per_s)
    level = max(level, _floor(per_s))
    values[at], values[at + 1] = level, now
    return level


def _floor(per_s: float) -> float:
    """The lowest a bucket goes (a token debt): the longest Retry-After lifts it above zero."""
    return 1 - per_s * RETRY_AFTER_MAX_S


def _wait_s(deficit: float, per_s: float) -> int:
    """Whole seconds until a refill of `per_s` covers `deficit` (Retry-After: 1 to RETRY_AFTER_MAX_S)."""
    return max(1, min(RETRY_AFTER_MAX_S, math.ceil(deficit / per_s)))


def too_many(tenant: str, what: str, retry_after: int) -> RouterError:
    return RouterError(
        429, f"tenant {tenant!r} is over its limit of {what}; retry after {retry_after}s", retry_after=retry_after
    )


@dataclass
class Ticket:
    """A request admitted for a tenant: `finish` once with the tokens its answer used."""

    quotas: TenantQuotas
    tenant: str
    limits: TenantLimits
    counted: bool = False  # holds one of the tenant's concurrent places
    done: bool = field(default=False)

    async def images(self, count: int) -> None:
        """Take `count` images from the tenant's per-minute bucket, or raise the 429."""
        if count and self.limits.images_per_min is not None:
            await self.quotas.run(lambda fallback: self.quotas.take_images(self, count, fallback=fallback))

    def finish(self, tokens: int, now: float | None = None) -> None:
        if not self.done:
            self.done = True
            self.quotas.finish(self, tokens, now)


class TenantQuotas:
    """Admission of each tenant's requests against its limits (one per router process).

    Every change goes to the shared table under its lock; while the table has a fault (busy
    past LOCK_WAIT_S, truncated, unusable) it goes to this process's own table instead, so a
    broken table costs the quota's accuracy (at most this process's share: its own full
    buckets), never a request. What a finished request gives back while the table has a fault
    (its concurrent place, its tokens) is kept here and written at the next change that gets
    the lock. This worker's in-flight counts are this process's to keep (`_mine`): it writes
    them whole, so a count it lost in a repaired table comes back."""

    def __init__(
        self,
        table: BucketTable,
        worker: int,
        metrics: TenantMetricsLike | None = None,
        configured: Collection[str] = (),
    ) -> None:
        if not 0 <= worker < MAX_WORKERS:
            raise ValueError(f"worker index {worker} outside 0..{MAX_WORKERS - 1}")
        self.table = table
        self.own = BucketTable()  # while the shared table has a fault
        self.worker = worker
        self.metrics = metrics
        self.configured: frozenset[str] = frozenset(configured)
        self._registered: int | None = None  # the table generation this worker is registered in
        self._mine: dict[str, int] = {}  # this worker's requests in flight, per tenant
        self._owed: dict[str, tuple[TenantLimits, int]] = {}  # not yet written: limits, tokens
        self._retry: asyncio.TimerHandle | None = None
        self._checked = -math.inf  # when the header was last seen to name this worker
        try:
            self._shared(lambda table: None, time.monotonic())
        except TableFault as fault:  # registered at the first change that gets the lock
            if fault.reason != "busy":
                self._fault(fault)

    def configure(self, tenants: Collection[str]) -> None:
        """The configured tenants (a reload): the others' slots are freed."""
        self.configured = frozenset(tenants)
        try:
            self._shared(lambda table: table.free_others(self.configured), time.monotonic())
        except TableFault as fault:  # freed by the next reload or claimed when needed (`slot`)
            self._fault(fault)
        self.own.free_others(self.configured)

    async def run(self, call: Callable[[bool], T]) -> T:
        """`call(fallback)` with the bounded wait for the shared table's lock: polled off the
        event loop for up to LOCK_WAIT_S (the lock is held for microseconds of arithmetic),
        then with `fallback` this process's own table answers."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + LOCK_WAIT_S
        while True:
            try:
                return call(loop.time() >= give_up)
            except TableFault:  # busy: another holds the lock
                await asyncio.sleep(LOCK_POLL_S)

    def admit(self, tenant: str, limits: TenantLimits, now: float | None = None, fallback: bool = True) -> Ticket:
        """One request of `tenant`: a Ticket, or the 429 (nothing taken) naming the limit hit.
        `fallback` False: a busy table raises TableFault (the caller waits and asks again)."""
        ticket = Ticket(self, tenant, limits)
        if limits.unlimited:
            self._count(tenant, "admitted")
            return ticket
        now = time.monotonic() if now is None else now
        refused = self._apply(lambda table, shared: self._admit(table, shared, ticket, now), now, fallback)
        if refused is not None:
            self._count(tenant, "refused")
            raise refused
        self._count(tenant, "admitted")
        return ticket

    def _admit(self, table: BucketTable, shared: bool, ticket: Ticket, now: float) -> RouterError | None:
        tenant = ticket.tenant
        slot = table.find(tenant, self.worker, now, self.configured)
        refused = self._check(slot, shared, ticket, now)
        if refused is None and ticket.limits.concurrent_requests is not None:
            ticket.counted = True
            self._mine[tenant] = self._mine.get(tenant, 0) + 1
        slot.counts[self.worker] = self._mine.get(tenant, 0)
        table.write(slot)  # a refusal too: the levels refilled to now are the same, a repair is kept
        return refused

    def _check(self, slot: Slot, shared: bool, ticket: Ticket, now: float) -> RouterError | None:
        """The 429 of the first limit `ticket` is over, else None with its request taken."""
        tenant, limits, values = ticket.tenant, ticket.limits, slot.buckets
        if limits.concurrent_requests is not None:
            held = self._mine.get(tenant, 0) + (sum(slot.counts) - slot.counts[self.worker] if shared else 0)
            if held >= limits.concurrent_requests:
                return too_many(tenant, f"{limits.concurrent_requests} concurrent requests", 1)
        if limits.tokens_per_min is not None:
            per_s = limits.tokens_per_min / 60
            level = _refill(values, TPM, limits.tokens_per_min, per_s, now)
            if level <= 0:
                return too_many(tenant, f"{limits.tokens_per_min} tokens per minute", _wait_s(-level + 1, per_s))
        if limits.requests_per_s is not None:
            rate = limits.requests_per_s
            level = _refill(values, RPS, max(1.0, rate), rate, now)
            if level < 1:
                return too_many(tenant, f"{rate:g} requests per second", _wait_s(1 - level, rate))
            values[RPS] = level - 1
        return None

    def take_images(self, ticket: Ticket, count: int, now: float | None = None, fallback: bool = True) -> None:
        limit = ticket.limits.images_per_min
        assert limit is not None
        if count > limit:
            self._count(ticket.tenant, "refused")
            raise RouterError(
                400, f"the request has {count} images; tenant {ticket.tenant!r} may send at most {limit} per minute"
            )
        now = time.monotonic() if now is None else now
        per_s = limit / 60

        def take(table: BucketTable, shared: bool) -> float | None:
            slot = table.find(ticket.tenant, self.worker, now, self.configured)
            level = _refill(slot.buckets, IPM, limit, per_s, now)
            if level < count:
                return level
            slot.buckets[IPM] = level - count
            slot.counts[self.worker] = self._mine.get(ticket.tenant, 0)
            table.write(slot)
            return None

        short = self._apply(take, now, fallback)
        if short is not None:
            self._count(ticket.tenant, "refused")
            raise too_many(ticket.tenant, f"{limit} images per minute", _wait_s(count - short, per_s))

    def finish(self, ticket: Ticket, tokens: int, now: float | None = None) -> None:
        """Give the ticket's place back and charge its tokens: now, or (the table busy) at the
        next change that gets the lock, retried off the event loop meanwhile."""
        limits, tenant = ticket.limits, ticket.tenant
        if self.metrics is not None and tokens:
            self.metrics.tokens(tenant, tokens)
        if ticket.counted:
            self._mine[tenant] = max(0, self._mine.get(tenant, 0) - 1)
        charge = tokens if limits.tokens_per_min is not None else 0
        if not ticket.counted and not charge:
            return
        owed = self._owed.get(tenant)
        self._owed[tenant] = (limits, charge + (owed[1] if owed else 0))
        now = time.monotonic() if now is None else now
        try:
            self._shared(lambda table: None, now)  # writes what is owed
        except TableFault as fault:
            self._fault(fault)
            self._write_owed(self.own, tenant, False, now)  # this process's table knows it now
            self._retry_later()

    def _retry_later(self, tries: int = 5000) -> None:
        """Write what is owed as soon as the lock is free (polled; bounded: ~10 s, then the
        next change of any request writes it)."""
        if self._retry is not None or tries <= 0:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        def again() -> None:
            self._retry = None
            if not self._owed:
                return
            try:
                self._shared(lambda table: None, time.monotonic())
            except TableFault:
                self._retry_later(tries - 1)

        self._retry = loop.call_later(LOCK_POLL_S, again)

    def _apply(self, op: Callable[[BucketTable, bool], T], now: float, fallback: bool) -> T:
        """`op(table, shared)` on the shared table, or (a fault; busy only with `fallback`) on
        this process's own."""
        try:
            return self._shared(lambda table: op(table, table.shared), now)
        except TableFault as fault:
            if fault.reason == "busy" and not fallback:
                raise
            self._fault(fault)
        with self.own.locked():
            return op(self.own, False)

    def _shared(self, op: Callable[[BucketTable], T], now: float) -> T:
        table = self.table
        table.acquire()
        try:
            check = time.monotonic()
            if check - self._checked >= tenant_table.FOLLOW_EVERY_S:  # another process may have repaired it
                self._checked = check
                if self._registered is not None and not table.registered(self.worker):
                    self._registered = -1
            if self._registered != table.generation:  # new to it, or it was started over
                table.register(self.worker, first=self._registered is None)
                if self._registered is not None:
                    for tenant, mine in self._mine.items():
                        if mine:
                            self._owed.setdefault(tenant, (TenantLimits(), 0))
                self._registered = table.generation
            for tenant in list(self._owed):
                self._write_owed(table, tenant, True, now)
            return op(table)
        finally:
            table.release()

    def _write_owed(self, table: BucketTable, tenant: str, settle: bool, now: float) -> None:
        """What `tenant` is owed, into `table` (`settle`: the table of record; else this
        process's own, and it stays owed)."""
        limits, tokens = self._owed[tenant]
        if not self.configured or tenant in self.configured:  # else: gone with a reload
            slot = table.find(tenant, self.worker, now, self.configured)
            if limits.tokens_per_min is not None and tokens:
                level = _refill(slot.buckets, TPM, limits.tokens_per_min, limits.tokens_per_min / 60, now)
                slot.buckets[TPM] = max(level - tokens, _floor(limits.tokens_per_min / 60))
            slot.counts[self.worker] = self._mine.get(tenant, 0)
            table.write(slot)
        if settle:  # written: owed no more
            del self._owed[tenant]

    def _fault(self, fault: TableFault) -> None:
        if not fault.counted:
            self.table.faults(fault.reason, str(fault))

    def _count(self, tenant: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.request(tenant, result)


class TenantMetricsLike(Protocol):
    """What TenantQuotas reports to (TenantMetrics)."""

    def request(self, tenant: str, result: str) -> None: ...

    def tokens(self, tenant: str, count: int) -> None: ...


OTHER_TENANTS = "_other"  # no tenant name starts with "_" (tenants_format.TENANT_NAME)


class TenantMetrics:
    """Per-tenant series (`tenant` label: the configured tenants, at most MAX_TENANTS, and
    OTHER_TENANTS): requests admitted and refused, tokens charged, each configured limit; and
    the shared table's faults by kind."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._requests = Counter(
            "epd_router_tenant_requests",
            "Chat requests per tenant: admitted or refused (429)",
            ["tenant", "result"],
            registry=registry,
        )
        self._tokens = Counter(
            "epd_router_tenant_tokens",
            "Tokens charged to a tenant (prompt + completion)",
            ["tenant"],
            registry=registry,
        )
        self._limits = Gauge(
            "epd_router_tenant_limit",
            "A tenant's configured limit",
            ["tenant", "limit"],
            multiprocess_mode="max",
            registry=registry,
        )
        self._faults = Counter(
            "epd_router_tenant_table_faults",
            "Faults of the tenants' shared table, by kind; each was repaired or answered from the process's own table",
            ["fault"],
            registry=registry,
        )
        self.configured: frozenset[str] = frozenset()
        self._logged: dict[str, float] = {}

    def request(self, tenant: str, result: str) -> None:
        self._requests.labels(tenant, result).inc()

    def tokens(self, tenant: str, count: int) -> None:
        self._tokens.labels(tenant).inc(count)

    def fault(self, reason: str, detail: str = "") -> None:
        """Counted each time; logged at most once a minute per kind."""
        self._faults.labels(reason).inc()
        now = time.monotonic()
        if now - self._logged.get(reason, -math.inf) >= 60:
            self._logged[reason] = now
            log.warning(
                "tenant table fault: repaired, or this process answers from its own buckets meanwhile",
                extra={"fault": reason, "error": detail or reason},
            )

    def limits(self, tenants: dict[str, TenantLimits]) -> None:
        self.configured = frozenset(tenants)
        self._limits.clear()  # a tenant gone from the file leaves the series (in this process)
        for tenant, limits in tenants.items():
            for name in LIMITS:
                value = getattr(limits, name)
                if value is not None:
                    self._limits.labels(tenant, name).set(value)

    def cap(self, families: Iterable[Metric]) -> Iterator[Metric]:
        """The families as /metrics shows them: a `tenant` value that is not a configured
        tenant (one a reload removed, one another process or an earlier run named) is summed
        into OTHER_TENANTS, and its limits are left out: the label has at most MAX_TENANTS + 1
        values whatever was ever counted (the files of a host's processes keep every series)."""
        for family in families:
            if not family.name.startswith("epd_router_tenant_") or family.name == "epd_router_tenant_table_faults":
                yield family
                continue
            capped = Metric(family.name, family.documentation, family.type, family.unit)
            folded: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                tenant = sample.labels.get("tenant")
                if tenant is None or tenant in self.configured:
                    capped.samples.append(sample)
                elif family.type != "gauge" and not sample.name.endswith("_created"):
                    labels = tuple(sorted({**sample.labels, "tenant": OTHER_TENANTS}.items()))
                    folded[sample.name, labels] = folded.get((sample.name, labels), 0.0) + sample.value
            for (name, labels), value in folded.items():
                capped.add_sample(name, dict(labels), value)
            yield capped


def count_images(messages: list) -> int:
    """Image parts in a request's messages (before any work is done on them)."""
    return sum(
        1
        for m in messages
        if isinstance(m.content, list)
        for part in m.content
        if isinstance(part, dict) and part.get("type") == "image_url"
    )


class Tenants:
    """A router process's tenants: the limits of the file last applied (replaced by a reload)
    and the buckets (kept across reloads: a tenant keeps its levels while its name stays; a
    tenant removed frees its slot). The table is made on the first file applied: a router
    without tenants has none."""

    def __init__(self, metrics: TenantMetrics, shared_dir: Path | None, worker: str | None = None) -> None:
        self.metrics = metrics
        # this process's name among the host's router processes (`epd-router serve --worker K`)
        self._worker = worker
        self.limits: dict[str, TenantLimits] = {}
        self._shared_dir = shared_dir
        self._quotas: TenantQuotas | None = None

    def apply(self, keys: TenantKeys | None) -> None:
        self.limits = dict(keys.tenants) if keys is not None else {}
        if keys is not None and self._quotas is None:
            self._quotas = TenantQuotas(*self._table(), self.metrics, configured=self.limits)
        elif self._quotas is not None:
            self._quotas.configure(self.limits)
        self.metrics.limits(self.limits)

    async def admit(self, tenant: str) -> Ticket:
        quotas = self._quotas
        assert quotas is not None, "a key with a tenant without a tenants file"
        # a tenant removed by a reload between the key check and here: no limits
        limits = self.limits.get(tenant) or TenantLimits()
        return await quotas.run(lambda fallback: quotas.admit(tenant, limits, fallback=fallback))

    def _table(self) -> tuple[BucketTable, int]:
        """The host's shared table when this process is one of its numbered workers and
        metrics are shared, else this process's own. A shared table that cannot be opened or
        made (the directory not writable) is the kit's error, logged and counted: this process
        then keeps its own table (its share of each limit) rather than not starting."""
        worker = self._worker
        if self._shared_dir is not None and worker is not None and worker.isdigit() and int(worker) < MAX_WORKERS:
            try:
                return BucketTable(self._shared_dir / TABLE_FILE, self.metrics.fault), int(worker)
            except TableFault as fault:
                self.metrics.fault(fault.reason, str(fault))
                log.error(
                    "tenant table unusable: this process enforces each tenant's limits on its own",
                    extra={"error": str(fault)},
                )
        return BucketTable(faults=self.metrics.fault), 0


def load_client_keys(api_keys_file: Path | None, tenants_file: Path | None) -> tuple[ApiKeyChecker, TenantKeys | None]:
    """The client keys of `auth.api_keys_file` (no tenant) and `auth.tenants_file` (each of
    its tenant); a key in both files is refused."""
    plain = load_api_keys(api_keys_file) if api_keys_file else ()
    tenants = load_tenants_file(tenants_file) if tenants_file else None
    if tenants is None:
        return ApiKeyChecker(plain), None
    if set(plain) & set(tenants.keys):
        raise KeyFileError(f"tenants_file {tenants_file}: a key is also in api_keys_file {api_keys_file}")
    owners = ("",) * len(plain) + tenants.owners
    return ApiKeyChecker(plain + tenants.keys, owners), tenants
