#!/bin/bash
# The sandbox demo (README command 1), as root on a fresh Debian 12 machine:
#   1. installs what it needs (scripts/bootstrap.sh),
#   2. builds the test-host rootfs once (cached) and boots the sandbox host(s): systemd-nspawn
#      containers with their own systemd and sshd, on 10.213.0.0/24 inside the network
#      namespace kithub (no uplink), each with the tiny checkpoint at /models/tiny-qwen3-vl,
#   3. deploys with the real playbook: ansible-playbook -i inventory/sandbox/one-host playbooks/deploy.yml
#      (same roles/templates as trn2; epd_engine_backend=sim),
#   4. sends one chat request (generated image + text; for a text-only fleet, text, and shows the
#      image request's 400; with several models, one per model and an unknown model's 404) through
#      the router with the openai client,
#      prints the answer, a status table and how to look around.
# The stack stays up. Tear down with: scripts/demo.sh --down
#   scripts/demo.sh [--inventory inventory/sandbox/three-host | .../text-only | .../two-models | .../vllm-cpu] | --down
set -euo pipefail
cd "$(dirname "$0")/.."
# needs root (systemd-nspawn, network namespaces): as root it runs as is; otherwise through sudo where there is one
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "demo.sh: needs root (systemd-nspawn, network namespaces); run it as root" >&2; exit 1; }
  exec sudo -E "$0" "$@"
fi

HOSTS=tests/hosts/hosts.sh
OUR_HOSTS=(n1 n2 n3 n4 n5 n6 n7 n8 n9)
INVENTORY=inventory/sandbox/one-host
HUB=(nsenter --net=/run/netns/kithub env PIP_RETRIES=0)
PY=.venv/bin/python

case "${1:-}" in
  --down)
    "$HOSTS" down "${OUR_HOSTS[@]}" 2>/dev/null || true
    "$HOSTS" net-down
    echo "demo: sandbox hosts stopped and the kithub network removed"; exit 0 ;;
  --inventory) INVENTORY=${2:?--inventory DIR}; shift 2 ;;
  "") ;;
  *) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
[ -f "$INVENTORY/hosts.yml" ] || { echo "demo.sh: no inventory at $INVENTORY" >&2; exit 1; }

T0=$SECONDS
step() { printf '\n== [%3ss] %s\n' $((SECONDS - T0)) "$*"; }

step "install dependencies (scripts/bootstrap.sh)"
scripts/bootstrap.sh
if [ ! -f playbooks/deploy.yml ]; then
  echo "demo.sh: playbooks/deploy.yml is not in this checkout yet: the sandbox cannot be deployed." >&2
  echo "         (the test hosts themselves work: see docs/sandbox.md 'Booting hosts by hand')" >&2
  exit 1
fi

step "test-host rootfs (built once, cached under /var/tmp/epd-kit) and the sandbox model"
"$HOSTS" prepare
SEED=$($PY tests/hosts/seed.py)
# deploy.yml builds the kit's offline wheelhouse on the controller; kithub has no route to a
# package index, so build (or find cached) it here first
$PY tests/hosts/wheelhouse.py
# a vllm-cpu inventory's engines install from vLLM's wheelhouse (roles/epd_deps install_vllm_cpu.yml), the
# archive scripts/compat-env.sh downloads (several GB once)
ENGINE_VLLM=$($PY tests/hosts/sandbox.py engine-vllm "$INVENTORY")
if [ -n "$ENGINE_VLLM" ]; then scripts/compat-env.sh --vllm "$ENGINE_VLLM" --wheelhouse; fi
SPECS=$($PY tests/hosts/sandbox.py hosts "$INVENTORY")

step "boot sandbox hosts: $SPECS"
"$HOSTS" down "${OUR_HOSTS[@]}" >/dev/null 2>&1 || true       # a previous demo or test run
"$HOSTS" net-up
# shellcheck disable=SC2086
SEED=$SEED "$HOSTS" up $SPECS

on_error() {
  echo >&2
  echo "demo.sh: FAILED (see above). The hosts are still up for a look: 'systemctl -M n1 status'," >&2
  echo "         'systemd-run -M n1 -P --wait -q journalctl -u \"epd*\"'. Tear down: scripts/demo.sh --down" >&2
}
trap on_error ERR

step "deploy: ansible-playbook -i $INVENTORY playbooks/deploy.yml"
"${HUB[@]}" .venv/bin/ansible-playbook -i "$INVENTORY" playbooks/deploy.yml

step "one chat request (generated image + text; text only for epd_text_only) through the router, openai client"
"${HUB[@]}" $PY tests/hosts/sandbox.py request "$INVENTORY"

step "status"
if [ -f playbooks/status.yml ]; then
  echo "ansible-playbook -i $INVENTORY playbooks/status.yml:"
  "${HUB[@]}" .venv/bin/ansible-playbook -i "$INVENTORY" playbooks/status.yml \
    | sed -n '/^ok: \[localhost\]/,/^PLAY RECAP/p' | sed -n 's/^    - //p' || true
  echo
fi
"${HUB[@]}" $PY tests/hosts/sandbox.py status "$INVENTORY"
trap - ERR

ROUTER=$($PY tests/hosts/sandbox.py router "$INVENTORY")
FIRST_SPEC=${SPECS%% *}; FIRST=${FIRST_SPEC%%:*}; FIRST_IP=${FIRST_SPEC#*:}
cat <<EOT

== [$((SECONDS - T0))s] the sandbox is running. Look around (as root):
  systemctl -M $FIRST list-units 'epd*'                   units on host $FIRST (also: status, stop, start, restart)
  systemctl -M $FIRST status epd-engine@pd-0
  systemd-run -M $FIRST -P --wait -q journalctl -u 'epd*' -n 50          the journal of the kit's units
  tests/hosts/hosts.sh ssh $FIRST_IP                        a root shell on $FIRST
  nsenter --net=/run/netns/kithub curl -s $ROUTER/pools      the router's view of the pools
  nsenter --net=/run/netns/kithub curl -s $ROUTER/metrics    Prometheus metrics
  nsenter --net=/run/netns/kithub .venv/bin/ansible-playbook -i $INVENTORY playbooks/status.yml
  nsenter --net=/run/netns/kithub .venv/bin/ansible-playbook -i $INVENTORY playbooks/rolling_restart.yml
Tear down:  scripts/demo.sh --down
EOT
