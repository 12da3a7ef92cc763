"""The tenants' shared table fails safe (router/tenants.py, issue 58): a slot with a value that
is not a number, a negative count, a count of a worker that no longer runs, a truncated,
replaced, deleted or foreign file, a lock someone else holds, a table full of names of earlier
configs: each costs at most one bucket's accuracy, never a crash or a 500; and the tenant
label of the metrics holds the configured tenants only, whatever was counted."""

from __future__ import annotations

import asyncio
import fcntl
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from epd_kit.plan.tenants_format import MAX_TENANTS, parse_tenants
from epd_kit.router import tenant_table
from epd_kit.router.errors import RouterError
from epd_kit.router.service import RouterService
from epd_kit.router.tenant_table import (
    _BUCKETS,
    _HEAD_BYTES,
    _NAME,
    _WORKER,
    LOCK_WAIT_S,
    MAGIC,
    MAX_WORKERS,
    SLOT,
    SLOTS_AT,
    TABLE_BYTES,
    TABLE_FILE,
    TPM,
    BucketTable,
)
from epd_kit.router.tenants import TenantLimits, TenantMetrics, TenantQuotas, Tenants
from epd_kit.router_yaml import parse_config
from tests.budget import scaled


class Faults:
    """What the table reports, by kind."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __call__(self, reason: str, detail: str = "") -> None:
        self.seen[reason] = self.seen.get(reason, 0) + 1


def quotas(path=None, worker: int = 0, faults: Faults | None = None, configured=("a", "b")) -> TenantQuotas:
    table = BucketTable(path, faults or Faults())
    return TenantQuotas(table, worker, TenantMetrics(CollectorRegistry()), configured=configured)


def refused(call) -> RouterError:
    with pytest.raises(RouterError) as info:
        call()
    assert info.value.status == 429, info.value
    return info.value


def slot_at(path, tenant: str) -> int:
    data = path.read_bytes()
    for i in range(MAX_TENANTS):
        at = SLOTS_AT + i * SLOT
        if data[at : at + _NAME.size].rstrip(b"\0") == tenant.encode():
            return at
    raise AssertionError(f"no slot of {tenant}")


def poke(path, at: int, fmt: str, *values) -> None:
    """A stray write into the file (what any process of the router's user may do)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack(fmt, *values), at)
    finally:
        os.close(fd)


def test_a_slot_holding_infinity_or_a_future_time_starts_over_instead_of_a_500(tmp_path):
    path = tmp_path / TABLE_FILE
    faults = Faults()
    q = quotas(path, faults=faults)
    limits = TenantLimits(tokens_per_min=600, requests_per_s=5)
    q.admit("a", limits, now=10.0).finish(100, now=10.0)
    at = slot_at(path, "a") + _NAME.size
    poke(path, at + 8 * TPM, "d", -math.inf)  # the level of its tokens
    q.admit("a", limits, now=11.0)  # used to raise OverflowError (a 500) computing Retry-After
    poke(path, at + 8 * TPM, "dd", 5.0, 1e300)  # a time far in the future
    q.admit("a", limits, now=12.0)
    assert faults.seen["slot"] == 2
    level, then = q.table.buckets(slot_at(path, "a"))[TPM : TPM + 2]
    assert math.isfinite(level) and then == 12.0


def test_a_negative_or_absurd_count_of_another_worker_lets_no_tenant_past_its_limit(tmp_path):
    path = tmp_path / TABLE_FILE
    one, two = quotas(path, 0), quotas(path, 1)
    limits = TenantLimits(concurrent_requests=2)
    two.admit("a", limits)
    counts_at = slot_at(path, "a") + _NAME.size + _BUCKETS.size
    poke(path, counts_at + 4, "i", -8)  # worker 1's count: a negative used to give 8 more places
    one.admit("a", limits)
    one.admit("a", limits)
    refused(lambda: one.admit("a", limits))
    assert one.table.concurrent(slot_at(path, "a")) == 2  # the repaired count was written back


def test_a_count_left_by_a_worker_that_no_longer_runs_is_reclaimed(tmp_path):
    path = tmp_path / TABLE_FILE
    faults = Faults()
    one = quotas(path, 0, faults)
    limits = TenantLimits(concurrent_requests=2)
    one.admit("a", limits)
    argv = [sys.executable, "-c", "import os; print(os.getpid())"]
    # a process that has exited: it holds nothing
    pid = int(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    poke(path, _HEAD_BYTES + 3 * _WORKER.size, "qq", pid, 12345)
    counts_at = slot_at(path, "a") + _NAME.size + _BUCKETS.size
    poke(path, counts_at + 4 * 3, "i", 2)  # its two requests: they used to lock the tenant out for good
    one.admit("a", limits)
    refused(lambda: one.admit("a", limits))  # its own two places, and no more
    assert faults.seen["dead_worker"] >= 1


def test_a_file_truncated_under_running_workers_is_repaired_without_sigbus(tmp_path):
    """In a child process: a SIGBUS (what a truncated memory map gave) kills it."""
    path = tmp_path / TABLE_FILE
    script = textwrap.dedent(
        f"""
        import os
        from prometheus_client import CollectorRegistry
        from epd_kit.router.tenants import BucketTable, TenantLimits, TenantMetrics, TenantQuotas
        faults = []
        q = TenantQuotas(BucketTable({str(path)!r}, lambda r, d="": faults.append(r)), 0,
                         TenantMetrics(CollectorRegistry()), configured=("a",))
        limits = TenantLimits(requests_per_s=100, concurrent_requests=5)
        q.admit("a", limits).finish(0)
        os.truncate({str(path)!r}, 100)
        q.admit("a", limits).finish(0)
        os.truncate({str(path)!r}, 0)
        q.admit("a", limits).finish(0)
        print(",".join(faults))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=scaled(60)
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["truncated,truncated"]
    assert path.stat().st_size == TABLE_BYTES


@pytest.fixture
def follow_at_once(monkeypatch):
    """Each change looks at the file's header and path (the router: once a second)."""
    monkeypatch.setattr(tenant_table, "FOLLOW_EVERY_S", 0.0)


def test_a_foreign_or_replaced_file_is_replaced_not_rewritten_and_every_holder_follows(tmp_path, follow_at_once):
    path = tmp_path / TABLE_FILE
    faults = Faults()
    one, two = quotas(path, 0, faults), quotas(path, 1, faults)
    limits = TenantLimits(concurrent_requests=2)
    one.admit("a", limits, now=0.0)
    old_inode = path.stat().st_ino
    poke(path, 0, "8s", b"epdtnt99")  # another layout's magic: not ours to rewrite in place
    two.admit("a", limits, now=5.0)  # two looks at the header (each second): a new file, by rename
    assert faults.seen["foreign"] == 1 and path.stat().st_ino != old_inode
    assert path.read_bytes()[: len(MAGIC)] == MAGIC
    refused(lambda: one.admit("a", limits, now=10.0))  # one follows the path: the two places are shared
    assert faults.seen["replaced"] == 1


# each layout the table file had, by its magic (its version, which names the file): a layout
# change without a new magic would have the old and the new processes of a rolling upgrade
# rewrite each other's file
LAYOUTS = {b"epdtnt02": ("8s3I", _HEAD_BYTES, "qq", "64s", "6d", "64i", MAX_TENANTS)}


def test_a_table_file_of_another_layout_is_never_opened_so_its_processes_keep_it(tmp_path):
    """Issue 58: the router truncated a table of another size in place at start (the magic it
    wrote was never checked), so a rolling upgrade that changes the layout emptied the table the
    old processes still mapped. The layout's version names the file: the files of other
    layouts beside it (the release before the versioned names used tenant-buckets.bin) are
    left whole, byte for byte."""
    assert LAYOUTS.get(MAGIC) == (
        tenant_table._HEAD.format,
        SLOTS_AT - MAX_WORKERS * _WORKER.size,
        _WORKER.format,
        _NAME.format,
        _BUCKETS.format,
        tenant_table._COUNTS.format,
        MAX_TENANTS,
    ), "the table's layout changed: give it a new MAGIC (and so a new file name), then add it here"
    assert MAGIC.decode() in TABLE_FILE
    others = {
        "tenant-buckets.bin": b"epdtnt01" + os.urandom(4096),  # another size and magic than ours
        "tenant-buckets-epdtnt03.bin": b"epdtnt03" + os.urandom(TABLE_BYTES - 8),
    }
    for name, data in others.items():
        (tmp_path / name).write_bytes(data)
    tenants = Tenants(TenantMetrics(CollectorRegistry()), tmp_path, worker="0")
    tenants.apply(parse_tenants("tenant a requests_per_s=1\nkey a sk-a\n", "f"))
    tenants._quotas.admit("a", TenantLimits(requests_per_s=1))
    refused(lambda: tenants._quotas.admit("a", TenantLimits(requests_per_s=1)))
    assert {name: (tmp_path / name).read_bytes() for name in others} == others
    assert (tmp_path / TABLE_FILE).read_bytes()[: len(MAGIC)] == MAGIC


def test_a_deleted_file_and_a_restarted_worker_share_one_table_again(tmp_path, follow_at_once):
    path = tmp_path / TABLE_FILE
    one = quotas(path, 0)
    limits = TenantLimits(concurrent_requests=2)
    one.admit("a", limits, now=0.0)
    path.unlink()
    restarted = quotas(path, 1)  # makes a new file; used to leave each with its own: the limit doubled
    restarted.admit("a", limits, now=5.0)
    refused(lambda: one.admit("a", limits, now=5.0))  # one follows the path (and brings its place)
    refused(lambda: restarted.admit("a", limits, now=6.0))


def test_a_file_that_cannot_be_opened_is_replaced_or_the_process_keeps_its_own(tmp_path):
    path = tmp_path / TABLE_FILE
    path.symlink_to(tmp_path / "elsewhere")  # a link is never followed: a new file replaces it
    faults = Faults()
    q = quotas(path, 0, faults)
    q.admit("a", TenantLimits(requests_per_s=1), now=0.0)
    assert path.is_file() and not path.is_symlink() and faults.seen == {"replaced": 1}
    # a directory where the file should be (nothing to replace it with): the kit's error at start,
    # counted; the router starts with its own table
    metrics = TenantMetrics(CollectorRegistry())
    blocked = tmp_path / "blocked"
    (blocked / TABLE_FILE).mkdir(parents=True)
    tenants = Tenants(metrics, blocked, worker="0")
    assert not tenants._table()[0].shared
    assert metrics._faults.labels("unusable")._value.get() == 1


def test_a_busy_lock_holds_a_request_at_most_lock_wait_then_the_process_answers_alone(tmp_path):
    path = tmp_path / TABLE_FILE
    faults = Faults()
    q = quotas(path, 0, faults)
    limits = TenantLimits(requests_per_s=1)

    async def scenario() -> float:
        holder = os.open(path, os.O_RDWR)  # another open file: its flock excludes ours
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            t = time.monotonic()
            ticket = await q.run(lambda fallback: q.admit("a", limits, fallback=fallback))
            waited = time.monotonic() - t
            ticket.finish(0)
        finally:
            os.close(holder)
        return waited

    waited = asyncio.run(scenario())
    assert LOCK_WAIT_S <= waited < LOCK_WAIT_S + 0.5, waited
    assert faults.seen["busy"] >= 1


def test_slots_are_for_configured_tenants_so_renamed_tenants_never_wipe_the_others(tmp_path):
    path = tmp_path / TABLE_FILE
    names = [f"n{i}" for i in range(MAX_TENANTS - 1)]
    q = quotas(path, configured=["a", *names])
    over = TenantLimits(tokens_per_min=60)
    q.admit("a", over, now=0.0).finish(600, now=0.0)  # 'a' owes ten minutes
    held = q.admit("a", TenantLimits(concurrent_requests=1), now=0.0)
    for name in names:
        q.admit(name, TenantLimits(requests_per_s=1), now=0.0)
    for round_ in range(2):  # reloads that rename every other tenant, twice: 510 new names
        renamed = [f"r{round_}-{i}" for i in range(MAX_TENANTS - 1)]
        q.configure(["a", *renamed])
        for name in renamed:
            q.admit(name, TenantLimits(requests_per_s=1), now=1.0)
    # a 257th name used to start the table over: 'a' admitted again, its place forgotten
    assert refused(lambda: q.admit("a", over, now=2.0)).retry_after > 500
    refused(lambda: q.admit("a", TenantLimits(concurrent_requests=1), now=2.0))
    held.finish(0)
    table = path.read_bytes()
    held_names = {table[SLOTS_AT + i * SLOT : SLOTS_AT + i * SLOT + _NAME.size].rstrip(b"\0") for i in range(256)}
    assert not any(n.startswith((b"n", b"r0-")) for n in held_names)


async def test_the_tenant_label_holds_the_configured_tenants_whatever_was_counted(tmp_path, config, char_renderer):
    tenants = tmp_path / "tenants"
    tenants.write_text("tenant a requests_per_s=1\nkey a sk-a\n")
    tenants.chmod(0o640)
    path = tmp_path / "r.yaml"
    cfg = config(auth={"tenants_file": str(tenants)})
    path.write_text(yaml.safe_dump(cfg))
    svc = RouterService(parse_config(cfg), char_renderer(), config_path=path)
    for round_ in range(3):  # reloads naming 200 new tenants each: 600 names counted in all
        lines = [f"tenant t{round_}-{i} tokens_per_min=100" for i in range(200)]
        tenants.write_text("\n".join([*lines, "tenant a", f"key t{round_}-0 sk-x", "key a sk-a"]) + "\n")
        assert svc.reload()
        for i in range(200):
            svc.tenants.metrics.request(f"t{round_}-{i}", "admitted")
            svc.tenants.metrics.tokens(f"t{round_}-{i}", 5)
    text = svc.metrics.render().decode()
    lines = [line for line in text.splitlines() if line.startswith("epd_router_tenant_")]
    labels = {line.split('tenant="', 1)[1].split('"', 1)[0] for line in lines}
    assert len(labels) == 201 and "_other" in labels and "t0-5" not in labels and "t2-5" in labels
    assert 'epd_router_tenant_tokens_total{tenant="_other"} 2000.0' in text  # rounds 0 and 1 summed
    assert 'epd_router_tenant_limit{limit="tokens_per_min",tenant="t0-1"}' not in text
    await svc.stop()


def test_a_worker_whose_registration_a_repair_wiped_registers_again(tmp_path, follow_at_once):
    """Another process laid the truncated file out again: this one's PID and places come back."""
    path = tmp_path / TABLE_FILE
    one, two = quotas(path, 0), quotas(path, 1)
    limits = TenantLimits(concurrent_requests=2)
    one.admit("a", limits)
    os.truncate(path, 0)
    two.admit("a", limits)  # two repairs the file: one's registration and count are gone from it
    one.admit("b", TenantLimits(requests_per_s=5))  # any change of one's: it registers again
    refused(lambda: two.admit("a", limits))  # one's place is back, and counted as a live worker's


@pytest.fixture
def shared_tmp():
    """A directory another user can reach (pytest's own is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="epd-quota-"))
    yield path
    for sub in path.rglob("*"):
        if sub.is_dir():
            sub.chmod(0o755)
    shutil.rmtree(path)


def test_an_unwritable_file_is_replaced_and_an_unwritable_directory_leaves_the_process_its_own(shared_tmp):
    """As a user that may not write the file (root may write anything: the child drops to
    nobody): a worker used to exit with a traceback, a crash loop under Restart=always."""
    script = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        from prometheus_client import CollectorRegistry
        from epd_kit.router.tenant_table import TABLE_FILE
        from epd_kit.router.tenants import TenantLimits, TenantMetrics, Tenants
        from epd_kit.plan.tenants_format import parse_tenants
        keys = parse_tenants("tenant a requests_per_s=1\\nkey a sk-a\\n", "f")
        for name in ("open", "closed"):
            directory = Path(sys.argv[1]) / name
            table = directory / TABLE_FILE
            table.write_text("")
            table.chmod(0o400)  # not writable, even by its owner
            if name == "closed":
                directory.chmod(0o555)  # and no new file can be made beside it
            metrics = TenantMetrics(CollectorRegistry())
            tenants = Tenants(metrics, directory, worker="0")
            tenants.apply(keys)
            shared = tenants._quotas.table.shared
            tenants._quotas.admit("a", TenantLimits(requests_per_s=1))
            faults = sorted(s.labels["fault"] for m in metrics._faults.collect() for s in m.samples
                            if s.name.endswith("_total") and s.value)
            print(name, shared, oct(table.stat().st_mode & 0o777), ",".join(faults))
        """
    )
    tmp_path = shared_tmp
    for name in ("open", "closed"):
        (tmp_path / name).mkdir()
    tmp_path.chmod(0o777)
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    if drop:
        for path in (tmp_path, tmp_path / "open", tmp_path / "closed"):
            os.chown(path, 65534, 65534)
    argv = [*drop, sys.executable, "-c", script, str(tmp_path)]
    run = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["open True 0o600 replaced", "closed False 0o400 unusable"], run.stdout
    assert "tenant table unusable: this process enforces each tenant's limits on its own" in run.stderr


def test_a_deleted_file_is_made_again_with_the_levels_a_running_process_holds(tmp_path, follow_at_once):
    path = tmp_path / TABLE_FILE
    one, two = quotas(path, 0), quotas(path, 1)
    limits = TenantLimits(tokens_per_min=60)
    one.admit("a", limits, now=0.0).finish(600, now=0.0)  # ten minutes owed
    path.unlink()
    assert refused(lambda: one.admit("a", limits, now=1.0)).retry_after > 500  # one made it again
    assert path.is_file()
    assert refused(lambda: two.admit("a", limits, now=1.0)).retry_after > 500  # two follows: the debt holds


async def test_what_a_request_gives_back_while_the_lock_is_busy_is_written_once_it_is_free(tmp_path):
    path = tmp_path / TABLE_FILE
    q = quotas(path)
    limits = TenantLimits(concurrent_requests=1, tokens_per_min=600)
    ticket = q.admit("a", limits, now=time.monotonic())
    holder = os.open(path, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        ticket.finish(1000)  # the place and the tokens: owed, not lost
    finally:
        os.close(holder)
    for _ in range(500):  # up to ~5 s: the retry runs on the loop, polling the lock
        if not q.table.concurrent(slot_at(path, "a")):
            break
        await asyncio.sleep(0.01)
    assert q.table.concurrent(slot_at(path, "a")) == 0
    assert q.table.buckets(slot_at(path, "a"))[TPM] < 0  # the 1000 tokens were charged
