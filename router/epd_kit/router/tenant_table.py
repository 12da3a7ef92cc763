"""The tenants' table (tenants.py): each tenant's buckets in a fixed-size slot, in this
process's memory or in a file the router processes of a host share, and how that file fails
safe (docs/router.md "Tenants"). A change reads and writes its slot under an exclusive flock
of the file, never waiting for it (`TableFault("busy")`: the caller waits, off the event loop);
each slot is validated on read; a damaged, foreign, deleted or replaced file is repaired or
followed. Every fault is a `TableFault` (the caller then uses its own table) or is repaired
and reported to `faults(kind, detail)`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import stat
import struct
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from epd_kit.plan.tenants_format import BOUNDS, MAX_TENANTS

MAX_WORKERS = 64  # concurrency counters per slot (epd_router_workers is far below)
LOCK_WAIT_S = 0.05  # the longest a request waits for the table's lock (then: this process's own)
LOCK_POLL_S = 0.002
FOLLOW_EVERY_S = 1.0  # how often a process looks whether the file at the path is still its own

# The file: a header (magic with the layout's version, the layout's sizes, each worker's PID
# and process start time), then the slots: the tenant's name, (level, time) of the three
# buckets, one concurrency count per worker. Read and written with pread/pwrite under the
# lock, never memory-mapped: a file truncated under a mapping kills its process with SIGBUS
# on the next access (issue 58); a short read is a fault the router repairs.
MAGIC = b"epdtnt02"
_HEAD = struct.Struct("8s3I")  # magic, slots, slot bytes, workers
_HEAD_BYTES = 32
_WORKER = struct.Struct("qq")  # pid, start time (clock ticks after boot, /proc/PID/stat field 22)
_NAME = struct.Struct("64s")
_BUCKETS = struct.Struct("6d")
_COUNTS = struct.Struct(f"{MAX_WORKERS}i")
SLOT = _NAME.size + _BUCKETS.size + _COUNTS.size
SLOTS_AT = _HEAD_BYTES + MAX_WORKERS * _WORKER.size
TABLE_BYTES = SLOTS_AT + MAX_TENANTS * SLOT
# the layout's version is in the file's name too: a rolling upgrade to another layout never
# opens (or repairs) the old processes' file
TABLE_FILE = f"tenant-buckets-{MAGIC.decode()}.bin"
RPS, TPM, IPM = 0, 2, 4  # offsets of (level, time) in the buckets
_HEADER = _HEAD.pack(MAGIC, MAX_TENANTS, SLOT, MAX_WORKERS).ljust(_HEAD_BYTES, b"\0")


class TableFault(Exception):
    """The shared table cannot be used for this change (`reason`: the metric's `fault`); the
    process uses its own table meanwhile."""

    def __init__(self, reason: str, detail: str = "", counted: bool = False) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.counted = counted  # already reported (by the repair that raised it)


@dataclass
class Slot:
    """One tenant's slot as read (validated by `BucketTable.read`)."""

    offset: int
    name: str
    buckets: list[float]
    counts: list[int]


class _Memory:
    """A process's own table."""

    path = None
    generation = 0

    def __init__(self) -> None:
        self.buf = bytearray(TABLE_BYTES)
        self.buf[:_HEAD_BYTES] = _HEADER

    def lock(self) -> bool:
        return True

    def unlock(self) -> None:
        pass

    def check(self, now: float) -> None:
        pass

    def read(self, at: int, size: int) -> bytes:
        return bytes(self.buf[at : at + size])

    def write(self, at: int, data: bytes) -> None:
        self.buf[at : at + len(data)] = data

    def close(self) -> None:
        pass


class _File:
    """The host's table file, opened without following a link. `check` (under the lock, each
    change) repairs what it finds: a file of another size is rewritten whole; every
    `FOLLOW_EVERY_S` it also reads the header (another magic or layout: the file is replaced
    by a new one, never rewritten in place) and follows the path when the file there is not
    the one it holds (deleted, or replaced by another process): so the processes of a host
    keep sharing one table whatever happens to the file."""

    def __init__(self, path: Path, faults: Callable[..., None]) -> None:
        self.path = path
        self._faults = faults
        self._checked = -math.inf
        self._laid_out = False  # by this process, or found so: a size of 0 later is a truncation
        self.generation = 0  # changes when the file is started over or replaced: register again
        self.fd = self._open()

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.ELOOP, errno.EROFS):
                raise TableFault("unusable", f"{self.path}: {exc.strerror}") from None
            # not ours to write (made read-only, a link): put a new file in its place
            fd = self._replace()
            self._faults("replaced")
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TableFault("unusable", f"{self.path} is not a regular file")
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _replace(self) -> int:
        """A new, empty table renamed over the path (the old file's holders follow)."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, TABLE_BYTES)
                os.pwrite(fd, _HEADER, 0)
                os.rename(tmp, self.path)
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise TableFault("unusable", f"cannot write {self.path.parent}: {exc.strerror}") from None
        return fd

    def lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise TableFault("unusable", f"{self.path}: lock: {exc.strerror}") from None
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def check(self, now: float) -> None:
        """Under the lock, before a change: at most once a second (a truncation in between
        shows as a short read, `read`)."""
        if self._laid_out and now - self._checked < FOLLOW_EVERY_S:
            return
        try:
            size = os.fstat(self.fd).st_size
            if size != TABLE_BYTES:  # new, or truncated or grown by someone else: start it over
                self._lay_out(counted=bool(size) or self._laid_out)
            self._laid_out = True
            self._checked = now
            try:
                there = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                there = None
            mine = os.fstat(self.fd)
            if there is None or (there.st_ino, there.st_dev) != (mine.st_ino, mine.st_dev):
                self._faults("replaced")
                self._swap(self._open())
            elif os.pread(self.fd, _HEAD_BYTES, 0) != _HEADER:  # another version's, or garbage
                self._faults("foreign")
                self._swap(self._replace())
        except OSError as exc:
            raise TableFault("unusable", f"{self.path}: {exc.strerror}") from None

    def _swap(self, fd: int) -> None:
        """Hold the file at the path from now on (locked, like the one it replaces). A new
        file starts with this table's slots: the levels survive a deleted file."""
        if not self.lock_other(fd):
            os.close(fd)
            self._checked = -math.inf  # look again on the next change
            raise TableFault("busy")
        if os.fstat(fd).st_size != TABLE_BYTES or os.pread(fd, _HEAD_BYTES, 0) != _HEADER:
            os.ftruncate(fd, TABLE_BYTES)
            os.pwrite(fd, _HEADER, 0)
            old = os.pread(self.fd, TABLE_BYTES - _HEAD_BYTES, _HEAD_BYTES)
            if len(old) == TABLE_BYTES - _HEAD_BYTES:
                os.pwrite(fd, old, _HEAD_BYTES)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = fd
        self.generation += 1

    @staticmethod
    def lock_other(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _lay_out(self, counted: bool) -> None:
        """Start the file over, empty (it is ours: a layout change has another file name)."""
        if counted:
            self._faults("truncated")
        os.ftruncate(self.fd, 0)
        os.ftruncate(self.fd, TABLE_BYTES)
        os.pwrite(self.fd, _HEADER, 0)
        self.generation += 1

    def read(self, at: int, size: int) -> bytes:
        try:
            data = os.pread(self.fd, size, at)
            if len(data) != size:  # truncated since the last look: repaired now, for the next change
                self._lay_out(counted=True)
                raise TableFault("truncated", counted=True)
        except OSError as exc:
            raise TableFault("unusable", f"{self.path}: read: {exc.strerror}") from None
        return data

    def write(self, at: int, data: bytes) -> None:
        try:
            written = os.pwrite(self.fd, data, at)
        except OSError as exc:
            raise TableFault("unusable", f"{self.path}: write: {exc.strerror}") from None
        if written != len(data):
            raise TableFault("unusable", f"{self.path}: short write")

    def close(self) -> None:
        os.close(self.fd)


class BucketTable:
    """The tenants' buckets: in-process (`path` None) or a file every process of the host
    opens, changed under an exclusive flock of it. A fault of the file (unusable at start,
    busy, truncated, replaced) is a `TableFault` that the caller answers with its own
    process's table; `faults` counts each by kind."""

    def __init__(self, path: Path | None = None, faults: Callable[..., None] | None = None) -> None:
        self._slots: dict[str, int] = {}
        self.faults: Callable[..., None] = faults or (lambda reason, detail="": None)
        self._store: _Memory | _File = _Memory() if path is None else _File(path, self.faults)
        self._alive: dict[int, tuple[float, bool]] = {}  # worker -> (checked at, alive)

    @property
    def shared(self) -> bool:
        return isinstance(self._store, _File)

    @property
    def generation(self) -> int:
        return self._store.generation

    def close(self) -> None:
        self._store.close()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The table, locked for this process (never waiting: `TableFault("busy")` when
        another holds it; callers wait off the event loop, `TenantQuotas.run`)."""
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def acquire(self) -> None:
        """`locked` without a generator: what each request runs twice."""
        if not self._store.lock():
            raise TableFault("busy")
        try:
            self._store.check(time.monotonic())
        except BaseException:
            self._store.unlock()
            raise

    def release(self) -> None:
        self._store.unlock()

    # -- workers

    def register(self, worker: int, first: bool = True) -> None:
        """A (re)started worker (`first`): its PID in the header, nothing in flight (what a
        previous run of it left is dropped); after a repair, its PID again. Under the lock."""
        pid = os.getpid()
        self._store.write(_HEAD_BYTES + worker * _WORKER.size, _WORKER.pack(pid, _started(pid) or 0))
        self._slots.clear()
        if not first:
            return
        zero = struct.pack("i", 0)
        for i in range(MAX_TENANTS):
            self._store.write(SLOTS_AT + i * SLOT + _NAME.size + _BUCKETS.size + 4 * worker, zero)

    def registered(self, worker: int) -> bool:
        """Whether the header still names this process as `worker` (a repair by another
        process lays it out empty)."""
        pid, started = _WORKER.unpack(self._store.read(_HEAD_BYTES + worker * _WORKER.size, _WORKER.size))
        return pid == os.getpid() and started == (_started(pid) or 0)

    def alive(self, worker: int, now: float) -> bool:
        """Whether the process registered as `worker` still runs (looked up at most once a second)."""
        checked = self._alive.get(worker)
        if checked is not None and now - checked[0] < FOLLOW_EVERY_S:
            return checked[1]
        pid, started = _WORKER.unpack(self._store.read(_HEAD_BYTES + worker * _WORKER.size, _WORKER.size))
        alive = pid == os.getpid() or _runs(pid, started)
        self._alive[worker] = (now, alive)
        return alive

    # -- slots

    def slot(self, tenant: str, configured: Collection[str] = ()) -> int:
        """The offset of `tenant`'s slot, claimed (full buckets) if it has none: an empty slot,
        else one of a tenant not in `configured` (a reload freed it). Under the lock."""
        name = tenant.encode()
        offset = self._slots.get(tenant)
        # checked each time: another process may have freed or taken it (a reload, a repair)
        if offset is not None and self._store.read(offset, _NAME.size).rstrip(b"\0") == name:
            return offset
        names = self._names()
        found = next((i for i, held in enumerate(names) if held == name), None)
        if found is None:
            found = next((i for i, held in enumerate(names) if not held), None)
        if found is None:
            found = next((i for i, held in enumerate(names) if held.decode(errors="replace") not in configured), None)
        if found is None:
            raise TableFault("full")
        offset = SLOTS_AT + found * SLOT
        if names[found] != name:
            self._store.write(offset, _NAME.pack(name) + _BUCKETS.pack(*_NEW) + _COUNTS.pack(*[0] * MAX_WORKERS))
        self._slots[tenant] = offset
        return offset

    def find(self, tenant: str, worker: int, now: float, configured: Collection[str]) -> Slot:
        """`tenant`'s slot, read (`read`) and claimed if it has none (`slot`). Under the lock."""
        offset = self._slots.get(tenant)
        if offset is not None:
            found = self.read(offset, worker, now)
            if found.name == tenant:  # still its: another process may have freed or taken it
                return found
        return self.read(self.slot(tenant, configured), worker, now)

    def _names(self) -> list[bytes]:
        data = self._store.read(SLOTS_AT, MAX_TENANTS * SLOT)
        return [data[i * SLOT : i * SLOT + _NAME.size].rstrip(b"\0") for i in range(MAX_TENANTS)]

    def free_others(self, configured: Collection[str]) -> None:
        """Empty the slots of tenants not in `configured` (a reload removed them). Under the lock."""
        wanted = {n.encode() for n in configured}
        for i, held in enumerate(self._names()):
            if held and held not in wanted:
                self._store.write(SLOTS_AT + i * SLOT, bytes(SLOT))
        self._slots = {t: o for t, o in self._slots.items() if t in configured}

    def read(self, offset: int, worker: int, now: float) -> Slot:
        """A slot as it may be trusted: a bucket that is not a number, infinite or from the
        future starts over (full); a count below 0, above any limit, or of a worker no longer
        running is dropped (a worker's own count is its process's to keep)."""
        data = self._store.read(offset, SLOT)
        buckets = list(_BUCKETS.unpack_from(data, _NAME.size))
        counts = list(_COUNTS.unpack_from(data, _NAME.size + _BUCKETS.size))
        for at in (RPS, TPM, IPM):
            level, then = buckets[at], buckets[at + 1]
            # a NaN level is a new bucket; comparisons with NaN or an infinity fail
            if level != level or (-math.inf < level < math.inf and 0 <= then <= now + 1):
                continue
            self.faults("slot")
            buckets[at], buckets[at + 1] = math.nan, 0.0
        if MAX_WORKERS - counts.count(0) > (counts[worker] != 0):  # another worker holds some
            for w, count in enumerate(counts):
                if count and w != worker:
                    if not 0 < count <= COUNT_MAX:
                        self.faults("slot")
                        counts[w] = 0
                    elif not self.alive(w, now):
                        self.faults("dead_worker")
                        counts[w] = 0
        name = data[: _NAME.size].rstrip(b"\0").decode(errors="replace")
        return Slot(offset, name, buckets, counts)

    def write(self, slot: Slot) -> None:
        packed = _BUCKETS.pack(*slot.buckets) + _COUNTS.pack(*slot.counts)
        self._store.write(slot.offset + _NAME.size, packed)

    # what tests look at
    def buckets(self, offset: int) -> list[float]:
        return list(_BUCKETS.unpack(self._store.read(offset + _NAME.size, _BUCKETS.size)))

    def concurrent(self, offset: int) -> int:
        return sum(_COUNTS.unpack(self._store.read(offset + _NAME.size + _BUCKETS.size, _COUNTS.size)))


_NEW = (math.nan, 0.0) * 3  # a new slot's buckets: full
COUNT_MAX = int(BOUNDS["concurrent_requests"][1])  # no worker holds more of one tenant


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, proc(5) /proc/PID/stat field 22),
    None if it does not run: with the PID, it names one process (PIDs are reused)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: fields follow the last ')'
        return int(stat_line[stat_line.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _runs(pid: int, started: int) -> bool:
    if pid <= 0:
        return False
    if started:
        return _started(pid) == started
    try:  # its start time was not known: any process of that PID
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
