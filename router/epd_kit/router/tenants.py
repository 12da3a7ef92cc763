"""Tenants: which tenant an API key belongs to, and each tenant's limits (requests per second,
concurrent requests, tokens per minute, images per minute), enforced with token buckets that
the router processes of one host share (docs/router.md "Tenants").

The file and its format: tenants_file.py.

Buckets: `requests_per_s` refills that many a second (burst: one second's worth, at least 1),
one taken per request; `images_per_min` refills per minute, as many taken as the request has
images; `tokens_per_min` refills per minute and is charged from the answer's usage (prompt +
completion) as the answer ends, so it may go below zero: a tenant is refused while its level
is not above zero, and Retry-After is the time the refill takes to lift it there.
`concurrent_requests` counts requests in flight. A refused request is a 429 in OpenAI's shape
with that Retry-After; it costs the tenant nothing.

Sharing: the buckets live in one table of fixed-size slots, in memory for a single process or
in a memory-mapped file under the metrics directory (`PROMETHEUS_MULTIPROC_DIR`, /run/epd-router)
for the processes of a host, each change under an exclusive `flock` of that file (two per
request, only when tenants are configured). Concurrency counts are kept per worker, so a
process that dies leaves no slots behind: its successor (the same worker name) clears them.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from epd_kit.router.auth import ApiKeyChecker, KeyFileError, load_api_keys, read_secret_file
from epd_kit.router.errors import RouterError
from epd_kit.router.tenants_file import LIMITS, MAX_TENANTS, TenantKeys, TenantLimits, parse_tenants


def load_tenants_file(path: Path) -> TenantKeys:
    text = read_secret_file(path, "tenants_file", group_readable=True)
    return parse_tenants(text, f"tenants_file {path}")


# --- the shared table -------------------------------------------------------------------------

MAX_WORKERS = 64  # concurrency counters per slot (epd_router_workers is far below)

# a slot: the tenant's name, then (level, time) of the three buckets, then one concurrency
# count per worker
_NAME = struct.Struct("64s")
_BUCKETS = struct.Struct("6d")
_COUNTS = struct.Struct(f"{MAX_WORKERS}i")
SLOT = _NAME.size + _BUCKETS.size + _COUNTS.size
MAGIC = b"epdtnt01"
TABLE_BYTES = len(MAGIC) + MAX_TENANTS * SLOT
RPS, TPM, IPM = 0, 2, 4  # offsets of (level, time) in the buckets


class BucketTable:
    """The tenants' buckets: in-process (`path` None) or a file every process of the host
    maps, changed under an exclusive flock of it."""

    def __init__(self, path: Path | None = None) -> None:
        self._fd: int | None = None
        self._slots: dict[str, int] = {}
        if path is None:
            self._buf: mmap.mmap | bytearray = bytearray(TABLE_BYTES)
            self._buf[: len(MAGIC)] = MAGIC
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        with _flock(fd):
            if os.fstat(fd).st_size != TABLE_BYTES:  # new, or of another layout: start empty
                os.ftruncate(fd, 0)
                os.ftruncate(fd, TABLE_BYTES)
                os.pwrite(fd, MAGIC, 0)
        self._fd = fd
        self._buf = mmap.mmap(fd, TABLE_BYTES)

    def close(self) -> None:
        if self._fd is not None:
            self._buf.close()  # type: ignore[union-attr]
            os.close(self._fd)
            self._fd = None

    @contextmanager
    def locked(self) -> Iterator[None]:
        if self._fd is None:
            yield
            return
        with _flock(self._fd):
            yield

    def slot(self, tenant: str) -> int:
        """The offset of `tenant`'s slot, claimed (full buckets) if it has none. Under the lock."""
        name = tenant.encode()
        offset = self._slots.get(tenant)
        # checked each time: another process may have started the table over (renamed tenants)
        if offset is not None and bytes(self._buf[offset : offset + _NAME.size]).rstrip(b"\0") == name:
            return offset
        for i in range(MAX_TENANTS):
            offset = len(MAGIC) + i * SLOT
            held = bytes(self._buf[offset : offset + _NAME.size]).rstrip(b"\0")
            if held == name:
                break
            if not held:
                _NAME.pack_into(self._buf, offset, name)
                _BUCKETS.pack_into(self._buf, offset + _NAME.size, math.nan, 0, math.nan, 0, math.nan, 0)
                break
        else:  # more names than slots over the file's life (renamed tenants): start over
            self._buf[len(MAGIC) :] = bytes(TABLE_BYTES - len(MAGIC))
            self._slots.clear()
            return self.slot(tenant)
        self._slots[tenant] = offset
        return offset

    def buckets(self, offset: int) -> list[float]:
        return list(_BUCKETS.unpack_from(self._buf, offset + _NAME.size))

    def set_buckets(self, offset: int, values: list[float]) -> None:
        _BUCKETS.pack_into(self._buf, offset + _NAME.size, *values)

    def concurrent(self, offset: int) -> int:
        return sum(_COUNTS.unpack_from(self._buf, offset + _NAME.size + _BUCKETS.size))

    def add_concurrent(self, offset: int, worker: int, delta: int) -> None:
        at = offset + _NAME.size + _BUCKETS.size + 4 * worker
        (value,) = struct.unpack_from("i", self._buf, at)
        struct.pack_into("i", self._buf, at, max(0, value + delta))

    def clear_worker(self, worker: int) -> None:
        """A (re)started worker has nothing in flight: drop what a previous run of it left."""
        with self.locked():
            for i in range(MAX_TENANTS):
                struct.pack_into("i", self._buf, len(MAGIC) + i * SLOT + _NAME.size + _BUCKETS.size + 4 * worker, 0)


@contextmanager
def _flock(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _refill(values: list[float], at: int, capacity: float, per_s: float, now: float) -> float:
    """The bucket's level now (a new bucket starts full), stored back into `values`."""
    level, then = values[at], values[at + 1]
    level = capacity if math.isnan(level) else min(capacity, level + max(0.0, now - then) * per_s)
    values[at], values[at + 1] = level, now
    return level


def _wait_s(deficit: float, per_s: float) -> int:
    """Whole seconds until a refill of `per_s` covers `deficit` (Retry-After: at least 1)."""
    return max(1, math.ceil(deficit / per_s))


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
    done: bool = field(default=False)

    def images(self, count: int) -> None:
        """Take `count` images from the tenant's per-minute bucket, or raise the 429."""
        if count and self.limits.images_per_min is not None:
            self.quotas.take_images(self, count)

    def finish(self, tokens: int, now: float | None = None) -> None:
        if not self.done:
            self.done = True
            self.quotas.finish(self, tokens, now)


class TenantQuotas:
    """Admission of each tenant's requests against its limits (one per router process)."""

    def __init__(self, table: BucketTable, worker: int, metrics: TenantMetricsLike | None = None) -> None:
        if not 0 <= worker < MAX_WORKERS:
            raise ValueError(f"worker index {worker} outside 0..{MAX_WORKERS - 1}")
        self.table = table
        self.worker = worker
        self.metrics = metrics
        table.clear_worker(worker)

    def admit(self, tenant: str, limits: TenantLimits, now: float | None = None) -> Ticket:
        """One request of `tenant`: a Ticket, or the 429 (nothing taken) naming the limit hit."""
        ticket = Ticket(self, tenant, limits)
        if limits.unlimited:
            self._count(tenant, "admitted")
            return ticket
        now = time.monotonic() if now is None else now
        table = self.table
        with table.locked():
            offset = table.slot(tenant)
            values = table.buckets(offset)
            refused: RouterError | None = None
            if limits.concurrent_requests is not None and table.concurrent(offset) >= limits.concurrent_requests:
                refused = too_many(tenant, f"{limits.concurrent_requests} concurrent requests", 1)
            if refused is None and limits.tokens_per_min is not None:
                per_s = limits.tokens_per_min / 60
                level = _refill(values, TPM, limits.tokens_per_min, per_s, now)
                if level <= 0:
                    refused = too_many(tenant, f"{limits.tokens_per_min} tokens per minute", _wait_s(-level + 1, per_s))
            if refused is None and limits.requests_per_s is not None:
                rate = limits.requests_per_s
                level = _refill(values, RPS, max(1.0, rate), rate, now)
                if level < 1:
                    refused = too_many(tenant, f"{rate:g} requests per second", _wait_s(1 - level, rate))
                else:
                    values[RPS] = level - 1
            if refused is None:
                table.set_buckets(offset, values)
                if limits.concurrent_requests is not None:
                    table.add_concurrent(offset, self.worker, 1)
        if refused is not None:
            self._count(tenant, "refused")
            raise refused
        self._count(tenant, "admitted")
        return ticket

    def take_images(self, ticket: Ticket, count: int, now: float | None = None) -> None:
        limit = ticket.limits.images_per_min
        assert limit is not None
        if count > limit:
            self._count(ticket.tenant, "refused")
            raise RouterError(
                400, f"the request has {count} images; tenant {ticket.tenant!r} may send at most {limit} per minute"
            )
        now = time.monotonic() if now is None else now
        per_s = limit / 60
        with self.table.locked():
            offset = self.table.slot(ticket.tenant)
            values = self.table.buckets(offset)
            level = _refill(values, IPM, limit, per_s, now)
            if level >= count:
                values[IPM] = level - count
                self.table.set_buckets(offset, values)
                return
        self._count(ticket.tenant, "refused")
        raise too_many(ticket.tenant, f"{limit} images per minute", _wait_s(count - level, per_s))

    def finish(self, ticket: Ticket, tokens: int, now: float | None = None) -> None:
        limits = ticket.limits
        if self.metrics is not None and tokens:
            self.metrics.tokens(ticket.tenant, tokens)
        if limits.concurrent_requests is None and (limits.tokens_per_min is None or not tokens):
            return
        now = time.monotonic() if now is None else now
        with self.table.locked():
            offset = self.table.slot(ticket.tenant)
            if limits.concurrent_requests is not None:
                self.table.add_concurrent(offset, self.worker, -1)
            if limits.tokens_per_min is not None and tokens:
                values = self.table.buckets(offset)
                level = _refill(values, TPM, limits.tokens_per_min, limits.tokens_per_min / 60, now)
                values[TPM] = level - tokens
                self.table.set_buckets(offset, values)

    def _count(self, tenant: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.request(tenant, result)


class TenantMetricsLike(Protocol):
    """What TenantQuotas reports to (TenantMetrics)."""

    def request(self, tenant: str, result: str) -> None: ...

    def tokens(self, tenant: str, count: int) -> None: ...


class TenantMetrics:
    """Per-tenant series (`tenant` label: at most MAX_TENANTS values): requests admitted and
    refused, tokens charged, and each configured limit."""

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

    def request(self, tenant: str, result: str) -> None:
        self._requests.labels(tenant, result).inc()

    def tokens(self, tenant: str, count: int) -> None:
        self._tokens.labels(tenant).inc(count)

    def limits(self, tenants: dict[str, TenantLimits]) -> None:
        self._limits.clear()  # a tenant gone from the file leaves the series (in this process)
        for tenant, limits in tenants.items():
            for name in LIMITS:
                value = getattr(limits, name)
                if value is not None:
                    self._limits.labels(tenant, name).set(value)


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
    and the buckets (kept across reloads: a tenant keeps its levels while its name stays).
    The table is made on the first file applied: a router without tenants has none."""

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
            self._quotas = TenantQuotas(*self._table(), self.metrics)
        self.metrics.limits(self.limits)

    def admit(self, tenant: str) -> Ticket:
        assert self._quotas is not None, "a key with a tenant without a tenants file"
        # a tenant removed by a reload between the key check and here: no limits
        return self._quotas.admit(tenant, self.limits.get(tenant) or TenantLimits())

    def _table(self) -> tuple[BucketTable, int]:
        """The host's shared table when this process is one of its numbered workers and
        metrics are shared, else this process's own."""
        worker = self._worker
        if self._shared_dir is not None and worker is not None and worker.isdigit() and int(worker) < MAX_WORKERS:
            return BucketTable(self._shared_dir / "tenant-buckets.bin"), int(worker)
        return BucketTable(), 0


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
