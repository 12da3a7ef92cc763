#!/usr/bin/env bash
# Run one benchmark section (or all) with the repo venv; results go to bench/results/,
# plots to docs/img/bench-*.png, and `bench.report` prints the Markdown tables for
# docs/benchmarks.md. Each section is bounded (count and time) and talks to 127.0.0.1 only.
#
#   bench/run.sh overhead|peers|instructions|preprocess|ve|pd|pd-sim|report|all [extra args for the section]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
section=${1:-}
shift || true
case "$section" in
  overhead)   exec "$PY" -m bench.router_overhead --profile "$@" ;;
  peers)      exec "$PY" -m bench.peers "$@" ;;
  instructions) exec "$PY" -m bench.instructions "$@" ;;
  preprocess) exec "$PY" -m bench.preprocess "$@" ;;
  ve)         exec "$PY" -m bench.ve_placement --sweep --what-if-slack 0 4 "$@" ;;
  pd)         exec "$PY" -m bench.pd_placement --through-router "$@" ;;
  pd-sim)     exec "$PY" -m bench.pd_placement_sim --utilisation 0.8 0.9 0.95 "$@" ;;
  report)     exec "$PY" -m bench.report "$@" ;;
  all)
    for s in ve pd-sim preprocess pd overhead; do
      echo "== $s"; "$0" "$s"
    done
    "$0" report ;;
  *)
    echo "usage: bench/run.sh overhead|peers|instructions|preprocess|ve|pd|pd-sim|report|all [args]" >&2
    exit 2 ;;
esac
