#!/bin/bash
# A busy machine on purpose: CPU burners to run beside the test suite (issue 55: the suite must
# pass, slower, with the load average >= 8 on this 2-core VM; docs/sandbox.md "Running the suite
# on a busy machine"). Each burner is a shell busy loop under `timeout`, so every one stops by
# itself after --seconds even if this script is killed with SIGKILL; Ctrl-C or SIGTERM stops them
# at once. Nothing here touches the network or the disk.
#   scripts/load.sh                        8 burners for 30 min (the suite's length and some)
#   scripts/load.sh --procs 12 --seconds 600
#   scripts/load.sh --procs 8 --seconds 2400 & CI=true .ci/run; kill %1
#   scripts/load.sh --procs 5 --hold 8     5 burners, and one more each minute the 1-minute load
#                                          average is under 8 (the suite's own load falls in its
#                                          last tier; up to MAX_PROCS, 64, burners)
set -euo pipefail

PROCS=8          # runnable processes: the load average climbs to about this plus what else runs
SECONDS_MAX=1800
LIMIT_S=7200     # no burner outlives two hours, whatever --seconds says
REPORT_S=60      # how often the load average is printed
HOLD=""          # --hold L: add a burner whenever the 1-minute load average reads under L
MAX_PROCS=64

usage() { echo "usage: scripts/load.sh [--procs N (1-$MAX_PROCS; 0 with --hold)] [--seconds S (1-$LIMIT_S)] [--hold L (1-$MAX_PROCS)]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --procs) PROCS=${2:-}; shift 2 || usage ;;
    --seconds) SECONDS_MAX=${2:-}; shift 2 || usage ;;
    --hold) HOLD=${2:-}; shift 2 || usage ;;
    -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "scripts/load.sh: unknown argument $1" >&2; usage ;;
  esac
done
whole() {   # whole FLAG VALUE LOW HIGH [NOTE]: VALUE a whole number from LOW to HIGH, or exit 2 naming FLAG
  [[ $2 =~ ^[0-9]+$ ]] && [ "$2" -ge "$3" ] && [ "$2" -le "$4" ] ||
    { echo "scripts/load.sh: $1 must be a whole number from $3 to $4${5:-}, got '$2'" >&2; exit 2; }
}
if [ -n "$HOLD" ]; then
  whole --hold "$HOLD" 1 $MAX_PROCS
  whole --procs "$PROCS" 0 $MAX_PROCS
else
  whole --procs "$PROCS" 1 $MAX_PROCS " (0 with --hold)"
fi
whole --seconds "$SECONDS_MAX" 1 $LIMIT_S

pids=()
stop() { trap - EXIT INT TERM; [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
trap stop EXIT
trap 'exit 130' INT TERM
burner() {   # burner SECONDS: one busy loop that stops by itself
  timeout "$1" sh -c 'while :; do :; done' &
  pids+=($!)
}
for _ in $(seq "$PROCS"); do burner "$SECONDS_MAX"; done
echo "load.sh: $PROCS CPU burners for at most ${SECONDS_MAX}s (pids ${pids[*]}); $(nproc) cores; load average now $(cut -d' ' -f1-3 /proc/loadavg)"
end=$((SECONDS + SECONDS_MAX))
while [ $SECONDS -lt $end ] && { [ ${#pids[@]} -eq 0 ] || kill -0 "${pids[@]}" 2>/dev/null; }; do
  # in the background: `wait` returns at once for a signal, so Ctrl-C/TERM stop the burners now
  sleep $((end - SECONDS < REPORT_S ? (end - SECONDS > 0 ? end - SECONDS : 1) : REPORT_S)) &
  wait $! || true
  read -r load1 _ </proc/loadavg
  echo "load.sh: $(date -u +%H:%M:%S) load average $(cut -d' ' -f1-3 /proc/loadavg) (${#pids[@]} burners)"
  # --hold: the 1-minute average lags a minute, so at most one burner a reading
  if [ -n "$HOLD" ] && [ "${load1%.*}" -lt "$HOLD" ] && [ ${#pids[@]} -lt $MAX_PROCS ] && [ $SECONDS -lt $end ]; then
    burner $((end - SECONDS))
    echo "load.sh: load $load1 under $HOLD: one more burner (${#pids[@]})"
  fi
done
[ ${#pids[@]} -eq 0 ] || wait "${pids[@]}" 2>/dev/null || true   # timeout exits 124 when it stopped a burner: expected
pids=()
echo "load.sh: done after ${SECONDS}s"
