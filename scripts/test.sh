#!/bin/bash
# THE test command: every tier (unit, contract, router, ansible, real systemd).
#   sudo scripts/test.sh                 everything
#   sudo scripts/test.sh tests/unit -x   any pytest arguments are passed through
# Installs what is missing (bootstrap.sh), builds the test hosts' rootfs once (cached),
# creates the kithub network namespace and runs pytest INSIDE it: tests can reach only
# lo and the test hosts 10.213.0.x, nothing else. Hosts and network are torn down on
# every exit path. "No tests collected" is a failure, never a silent pass.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "test.sh: the real-systemd tier needs root: sudo $0 $*" >&2; exit 1; }

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
summary() {
  echo "== timings"; printf '   %s\n' "${TIMES[@]}"; printf '   %-22s %4ss\n' total $((SECONDS - T0))
}
teardown() {
  local rc=$?
  trap - EXIT INT TERM
  "$HOSTS" down "${OUR_HOSTS[@]}" >/dev/null 2>&1 || true
  "$HOSTS" net-down || true
  summary
  exit $rc
}

phase bootstrap scripts/bootstrap.sh
phase rootfs "$HOSTS" prepare
# the deploy's controller-side wheelhouse needs a package index: build it before entering kithub
phase wheelhouse .venv/bin/python tests/hosts/wheelhouse.py
phase sandbox-model .venv/bin/python tests/hosts/seed.py
# leftovers of an interrupted earlier run (CI kills processes, not namespaces or cgroups)
"$HOSTS" down "${OUR_HOSTS[@]}" >/dev/null 2>&1 || true
trap teardown EXIT
trap 'exit 130' INT TERM
phase net-up "$HOSTS" net-up

set +e
# PIP_RETRIES=0: inside kithub any package-index access fails at once instead of retrying for minutes
phase pytest nsenter --net=/run/netns/kithub env PIP_RETRIES=0 \
  .venv/bin/python -m pytest -ra "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "test.sh: FAILED: pytest collected no tests (arguments: ${*:-none}); a test run that tests nothing is a failure" >&2
  exit 1
fi
exit $rc
