#!/bin/bash
# Local "hosts" for the real-systemd test tier and the sandbox demo: systemd-nspawn
# containers on one shared read-only rootfs (overlay per host), each with its own systemd
# (PID 1), sshd and address 10.213.0.x on a bridge inside the network namespace $HUB,
# which has no uplink: nothing in there can reach anything but lo and the other hosts.
#
#   hosts.sh prepare                    ssh key, base rootfs of every variant (cached by a hash of build-rootfs.sh),
#                                       Debian's haproxy .debs for the HAProxy tests (cached in $KIT_DIR/haproxy-debs)
#   hosts.sh net-up                     tmpfs for nspawn, safety route, hub netns + bridge
#   hosts.sh up NAME:IP [NAME:IP ...]   boot (fresh by default), wait for systemd and sshd
#   hosts.sh down NAME [NAME ...]       poweroff, then hard-stop and sweep what is left (HARD=1: no poweroff)
#   hosts.sh down-all                   down every host that has state under $STATE
#   hosts.sh net-down [--force]         remove hub netns/bridge + safety route (refused while hosts run)
#   hosts.sh list                       running hosts: NAME LEADER-PID
#   hosts.sh ssh IP [CMD ...]           ssh as root into a host (from inside the hub netns)
#   hosts.sh env                        print the resolved settings (shell syntax)
#
# env: KIT_DIR (/var/tmp/epd-kit), VARIANT=dlami|bare (the base rootfs hosts boot on: the DLAMI
#      stand-in, or a bare image without libfabric for playbooks/provision.yml), BASE, STATE,
#      SSH_KEY, MODE=hub|host, HUB, BR, NET,
#      FRESH=1|0 (wipe the host's upper dir on up), SEED=DIR (copied into every host's / on up),
#      LAYERS=DIR[:DIR...] (up: read-only layers between the base rootfs and the host's own upper
#      dir, leftmost lowest; a file there is copied up when the host changes it),
#      SHARED=HOSTDIR:PATH (up: bind-mount HOSTDIR, which must lie under $KIT_DIR/shared/, into every
#      host of this call at PATH: one file system the same everywhere, the sandbox's NFS/FSx share)
#      EPD_WAIT_FACTOR=N (1-99: the boot, systemd and sshd polls wait N times a quiet machine's)
# Reserved names/addresses: n1-n9 = 10.213.0.11-19 (tests, demo), cp1-cp3 = 10.213.0.21-23.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
KIT_DIR=${KIT_DIR:-/var/tmp/epd-kit}
VARIANT=${VARIANT:-dlami}
ROOTFS_HASH=$(sha256sum "$HERE/build-rootfs.sh" | cut -c1-12)
rootfs_dir() { if [ "$1" = dlami ]; then echo "$KIT_DIR/rootfs-$ROOTFS_HASH"; else echo "$KIT_DIR/rootfs-$1-$ROOTFS_HASH"; fi; }
BASE=${BASE:-$(rootfs_dir "$VARIANT")}
STATE=${STATE:-$KIT_DIR/hosts}
SSH_KEY=${SSH_KEY:-$KIT_DIR/id_ed25519}
MODE=${MODE:-hub}          # hub: bridge in netns $HUB (no uplink); host: bridge in the host netns
HUB=${HUB:-kithub}
BR=${BR:-kitbr0}
NET=${NET:-10.213.0}       # a /24 that exists only on our bridge
# the boot, systemd and sshd waits below are polls of a quiet machine's count times this (a whole
# number; tests/hosts/harness.py passes tests/budget.py's factor, rounded up)
WAIT_FACTOR=${EPD_WAIT_FACTOR:-1}
[[ $WAIT_FACTOR =~ ^[1-9][0-9]?$ ]] || { echo "hosts.sh: EPD_WAIT_FACTOR must be a whole number 1-99, got '$WAIT_FACTOR'" >&2; exit 2; }
# the bridge's fixed, locally administered MAC: 02 then the three octets of $NET, then 00:01
BRIDGE_MAC=$(IFS=.; printf '02:%02x:%02x:%02x:00:01' $NET)
SSH_OPTS=(-i "$SSH_KEY" -o BatchMode=yes -o StrictHostKeyChecking=no
          -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=2)

die() { echo "hosts.sh: $*" >&2; exit 1; }
SHARED=${SHARED:-}
[ "$(id -u)" = 0 ] || die "must run as root (systemd-nspawn, network namespaces, cgroups)"

in_hub() { if [ "$MODE" = hub ]; then nsenter --net=/run/netns/$HUB "$@"; else "$@"; fi; }
netns() { if [ "$MODE" = hub ]; then ip -n "$HUB" "$@"; else ip "$@"; fi; }
leader_alive() {   # the container's PID 1 still runs
  local l; l=$(cat "$STATE/$1/leader.pid" 2>/dev/null) || return 1
  [ -n "$l" ] && [ "$(cat /proc/$l/comm 2>/dev/null)" = systemd ]
}

prepare() {
  mkdir -p "$KIT_DIR"
  ( flock 9; [ -f "$SSH_KEY" ] || ssh-keygen -t ed25519 -N '' -q -C epd-kit-test-hosts -f "$SSH_KEY" ) 9>"$SSH_KEY.lock"
  "$HERE/build-rootfs.sh" "$BASE" "$VARIANT"
  local other
  for other in dlami bare; do
    [ "$other" = "$VARIANT" ] || "$HERE/build-rootfs.sh" "$(rootfs_dir "$other")" "$other"
  done
  fetch_haproxy_debs
}

# The test hosts have no package mirror (kithub has no uplink): the HAProxy role installs from
# .deb files (epd_haproxy_deb_dir). Fetch them here, outside the namespace, once; a partial
# download never counts as the cache (temporary directory, renamed when complete).
HAPROXY_DEBS=$KIT_DIR/haproxy-debs
fetch_haproxy_debs() {
  compgen -G "$HAPROXY_DEBS/haproxy_*.deb" >/dev/null && return 0
  local tmp="$HAPROXY_DEBS.tmp.$$"
  rm -rf "$tmp"
  # apt-get download needs the package lists; a fresh machine may have none yet
  apt-cache show haproxy >/dev/null 2>&1 || apt-get update -qq
  "$HERE/../../roles/epd_haproxy/files/fetch-debs.sh" "$tmp" >/dev/null \
    || { rm -rf "$tmp"; die "could not download Debian's haproxy packages (fetch-debs.sh); the HAProxy tests need them"; }
  rm -rf "$HAPROXY_DEBS"
  mv "$tmp" "$HAPROXY_DEBS"
  echo "hosts.sh: haproxy packages cached in $HAPROXY_DEBS"
}

ensure_runtime() {
  # /run is plain ext4 on these VMs: nspawn refuses to rm -rf its propagate dir there
  mkdir -p /run/systemd/nspawn /run/systemd/machines
  findmnt -n /run/systemd/nspawn >/dev/null || mount -t tmpfs -o mode=0755 tmpfs /run/systemd/nspawn
}

ensure_net() {
  # safety net: anything for 10.213.0.0/16 that is not on our bridge fails locally
  # ("No route to host") instead of following the default route out of eth0
  ip route replace unreachable "${NET%.*}.0.0/16"
  if [ "$MODE" = hub ] && [ ! -e /run/netns/$HUB ]; then
    ip netns add "$HUB"; ip -n "$HUB" link set lo up
    ip -n "$HUB" route replace unreachable "${NET%.*}.0.0/16"
  fi
  if ! netns link show "$BR" >/dev/null 2>&1; then
    netns link add "$BR" type bridge
    netns addr add "$NET.1/24" dev "$BR"
    netns link set "$BR" up
  fi
  # A bridge without an address of its own takes the lowest MAC of its ports, so it changes
  # whenever a host's veth joins or leaves. Every other host still has $NET.1 at the old MAC
  # in its ARP cache and cannot reach the hub until that entry expires (up to ~45 s: the
  # controller's stand-in server "timed out" in the middle of a provisioning test while the
  # other lane booted and stopped hosts). A set address never changes (addr_assign_type 3).
  netns link set "$BR" address "$BRIDGE_MAC"
}

# A host that installed the kit keeps ~0.5-1 GB of small files in its upper dir (venvs, the
# wheelhouse, the trace store's venv): deleting them before the next boot took ~23 s a host on
# this VM under load (a 568 MB copy of the kit install: 23 s, 0.6 CPU-s), one host after the
# other. So a boot moves them aside (a rename) and deletes them beside itself, at idle priority.
discard() {   # discard DIR...
  local trash dir
  trash=$(mktemp -d "$STATE/.trash.XXXXXX")   # one per call: two lanes boot hosts at once
  for dir in "$@"; do [ ! -e "$dir" ] || mv "$dir" "$trash/$(basename "$dir")"; done
  # what an interrupted run left aside (an hour old: never a deletion still running) goes too
  (setsid nice -n 19 ionice -c 3 sh -c 'rm -rf "$1"; find "$2" -maxdepth 1 -name ".trash.*" -mmin +60 -exec rm -rf {} +' \
    sh "$trash" "$STATE" </dev/null >/dev/null 2>&1 &)
}

up_one() {
  local name=$1 ip=$2 d=$STATE/$1
  [[ $name =~ ^[a-z][a-z0-9-]{0,30}$ ]] || die "bad host name '$name'"
  [[ $ip == "$NET".* ]] || die "address $ip is outside $NET.0/24: test hosts live only there"
  [ -x "$BASE/lib/systemd/systemd" ] || die "no base rootfs at $BASE: run 'hosts.sh prepare' first"
  [ -f "$SSH_KEY.pub" ] || die "no ssh key $SSH_KEY: run 'hosts.sh prepare' first"
  leader_alive "$name" && down_all "$name"
  [ "${FRESH:-1}" = 1 ] && discard "$d/upper" "$d/work"   # default: a pristine host on every boot
  mkdir -p "$d/upper/etc/systemd/network" "$d/upper/root/.ssh"
  [ -n "${SEED:-}" ] && cp -a "$SEED/." "$d/upper/"
  echo "$name" > "$d/upper/etc/hostname"
  # the host name resolves locally (sudo looks it up on every call)
  printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n127.0.1.1 %s\n' "$name" > "$d/upper/etc/hosts"
  install -m600 "$SSH_KEY.pub" "$d/upper/root/.ssh/authorized_keys"
  chmod 700 "$d/upper/root/.ssh"
  # the same key for the sudo user kitops (uid/gid from the base rootfs)
  local ops_ids; ops_ids=$(awk -F: '$1=="kitops"{print $3":"$4}' "$BASE/etc/passwd")
  if [ -n "$ops_ids" ]; then
    install -d -m"$(stat -c %a "$BASE/home/kitops")" -o "${ops_ids%:*}" -g "${ops_ids#*:}" "$d/upper/home/kitops"
    install -d -m700 -o "${ops_ids%:*}" -g "${ops_ids#*:}" "$d/upper/home/kitops/.ssh"
    install -m600 -o "${ops_ids%:*}" -g "${ops_ids#*:}" "$SSH_KEY.pub" "$d/upper/home/kitops/.ssh/authorized_keys"
  fi
  cat > "$d/upper/etc/systemd/network/10-host0.network" <<NETWORK
[Match]
Name=host0
[Network]
Address=$ip/24
Gateway=$NET.1
LinkLocalAddressing=no
IPv6AcceptRA=no
LLDP=no
EmitLLDP=no
NETWORK
  echo "$ip" > "$d/address"
  local binds=()
  if [ -n "$SHARED" ]; then   # checked in `up`: HOSTDIR:PATH
    binds=(--bind="$SHARED")
    echo "$SHARED" > "$d/shared"
  else
    rm -f "$d/shared"
  fi
  # one cgroup per container: with --keep-unit and no systemd on the host, nspawn splits
  # its *current* cgroup into payload/ + supervisor/, so two containers started from
  # the same cgroup would collide
  for h in systemd unified; do mkdir -p /sys/fs/cgroup/$h/kit-$name; done
  (
    echo $BASHPID > /sys/fs/cgroup/systemd/kit-$name/cgroup.procs
    echo $BASHPID > /sys/fs/cgroup/unified/kit-$name/cgroup.procs
    pre=(); [ "$MODE" = hub ] && pre=(nsenter --net=/run/netns/$HUB)   # NOT `ip netns exec`: it remounts /sys and hides the cgroup mounts
    exec setsid "${pre[@]}" systemd-nspawn --quiet --boot --directory="$BASE" \
      --overlay="$BASE${LAYERS:+:$LAYERS}:$d/upper:/" \
      --machine="$name" --register=no --keep-unit "${binds[@]}" \
      --network-bridge="$BR" --console=passive --resolv-conf=off --timezone=off \
      </dev/null >"$d/nspawn.log" 2>&1
  ) &
  echo $! > "$d/nspawn.pid"
}

# SHARED=HOSTDIR:PATH: HOSTDIR (created when missing) must be a directory under $KIT_DIR/shared/ and
# PATH absolute; both without '..', ':' or ','. The hosts see one directory: what one writes, the
# others read at once (findmnt in each host shows the same source and type, as for an NFS export)
check_shared() {
  [ -n "$SHARED" ] || return 0
  local src=${SHARED%%:*} dst=${SHARED#*:}
  [[ $SHARED == *:* && $src == "$KIT_DIR/shared/"?* && $dst == /?* ]] \
    || die "SHARED=$SHARED: want HOSTDIR:PATH with HOSTDIR under $KIT_DIR/shared/ and PATH absolute"
  [[ $SHARED != *..* && $dst != *:* && $SHARED != *,* ]] || die "SHARED=$SHARED: no '..', ',' or second ':'"
  mkdir -p "$src"
}

check_layers() {   # LAYERS=DIR[:DIR...]: absolute directories, no ',' (overlayfs separates options with it)
  local layer layers; IFS=: read -ra layers <<<"${LAYERS:-}"
  for layer in "${layers[@]}"; do
    [[ $layer == /* && -d $layer && $layer != *,* ]] || die "LAYERS: '$layer' is not an existing absolute directory (no ',')"
  done
}

register() {   # /run/systemd/machines/NAME with LEADER= is all `systemctl -M`/`systemd-run -M` need
  local name=$1 p l=
  p=$(cat "$STATE/$1/nspawn.pid")
  for _ in $(seq $((100 * WAIT_FACTOR))); do
    l=$(pgrep -P "$p" -x systemd || true); [ -n "$l" ] && break; sleep 0.1
  done
  [ -n "$l" ] || { cat "$STATE/$name/nspawn.log" >&2; die "$name: systemd did not start"; }
  printf 'NAME=%s\nLEADER=%s\nCLASS=container\nSTATE=running\n' "$name" "$l" > /run/systemd/machines/$name
  echo "$l" > "$STATE/$name/leader.pid"
}

wait_up() {
  local name=$1 ip=$2 s=
  for _ in $(seq $((300 * WAIT_FACTOR))); do
    s=$(systemctl -M "$name" is-system-running 2>/dev/null || true)
    case "$s" in running|degraded) break;; esac; sleep 0.1
  done
  case "$s" in running|degraded) ;; *) die "$name: boot timeout after $((30 * WAIT_FACTOR)) s of polls (state '$s'), see $STATE/$name/nspawn.log";; esac
  for _ in $(seq $((50 * WAIT_FACTOR))); do
    in_hub ssh "${SSH_OPTS[@]}" root@"$ip" true 2>/dev/null && { echo "$name $ip: $s, ssh ok"; return 0; }
    sleep 0.2
  done
  die "$name: sshd on $ip did not answer within $((10 * WAIT_FACTOR)) s of polls"
}

down_all() {   # HARD=1: no poweroff, the hard stop at once (for a host whose disk is wiped next)
  local name p l pids
  if [ "${HARD:-0}" != 1 ]; then
    for name in "$@"; do leader_alive "$name" && { systemctl -M "$name" poweroff 2>/dev/null || true; }; done
  fi
  for name in "$@"; do
    p=$(cat "$STATE/$name/nspawn.pid" 2>/dev/null || true)
    if [ -n "$p" ] && [ "${HARD:-0}" != 1 ]; then
      for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    fi
    # hard stop: SIGKILL the container's PID 1 (takes its whole PID namespace down;
    # SIGKILL of systemd-nspawn alone would leave the container running, orphaned),
    # then sweep anything left in the container's cgroup, by PID
    leader_alive "$name" && kill -KILL "$(cat "$STATE/$name/leader.pid")" 2>/dev/null || true
    # systemd-nspawn ends once its container has (it unmounts the host's overlay): the next boot of
    # this name starts only after that
    if [ -n "$p" ]; then
      for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
    fi
    if [ -d /sys/fs/cgroup/systemd/kit-$name ]; then
      for _ in 1 2 3 4 5; do
        pids=$(find /sys/fs/cgroup/systemd/kit-$name -name cgroup.procs -exec cat {} + 2>/dev/null)
        [ -z "$pids" ] && break
        kill -KILL $pids 2>/dev/null || true; sleep 0.3
      done
    fi
    rm -f /run/systemd/machines/$name "$STATE/$name/nspawn.pid" "$STATE/$name/leader.pid"
    for h in systemd unified; do
      [ -d /sys/fs/cgroup/$h/kit-$name ] && find /sys/fs/cgroup/$h/kit-$name -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
  done
}

running_hosts() {
  local d
  for d in "$STATE"/*/; do
    [ -d "$d" ] || continue
    d=$(basename "$d"); leader_alive "$d" && echo "$d $(cat "$STATE/$d/leader.pid")"
  done
  return 0
}

net_down() {
  if [ "${1:-}" != --force ] && [ -n "$(running_hosts)" ]; then
    echo "hosts.sh: network kept, hosts still running: $(running_hosts | cut -d' ' -f1 | tr '\n' ' ')" >&2
    return 0
  fi
  if [ "$MODE" = hub ]; then ip netns del "$HUB" 2>/dev/null || true; else ip link del "$BR" 2>/dev/null || true; fi
  ip route del unreachable "${NET%.*}.0.0/16" 2>/dev/null || true
}

cmd=${1:-help}; shift || true
case "$cmd" in
  prepare) prepare ;;
  up)
    [ $# -gt 0 ] || die "usage: hosts.sh up NAME:IP [NAME:IP ...]"
    ensure_runtime; ensure_net; mkdir -p "$STATE"
    check_shared; check_layers
    # a fresh boot wipes the host's disk, so a running host is stopped hard, every one at once: a
    # poweroff waited up to 10 s for each host's services to stop (the engines' and the router's
    # drains), one host after the other, for nothing (FRESH=0 keeps the disk: a poweroff first)
    alive=(); for spec in "$@"; do leader_alive "${spec%%:*}" && alive+=("${spec%%:*}"); done
    [ ${#alive[@]} -eq 0 ] || HARD=$([ "${FRESH:-1}" = 1 ] && echo 1 || echo 0) down_all "${alive[@]}"
    for spec in "$@"; do up_one "${spec%%:*}" "${spec##*:}"; done
    for spec in "$@"; do register "${spec%%:*}"; done
    for spec in "$@"; do wait_up "${spec%%:*}" "${spec##*:}"; done ;;
  down) down_all "$@" ;;
  down-all)
    names=(); for d in "$STATE"/*/; do [ -d "$d" ] && names+=("$(basename "$d")"); done
    [ ${#names[@]} -gt 0 ] && down_all "${names[@]}"; true ;;
  net-up) ensure_runtime; ensure_net ;;
  net-down) net_down "${1:-}" ;;
  list) running_hosts ;;
  ssh) ip=${1:?usage: hosts.sh ssh IP [CMD ...]}; shift; in_hub ssh "${SSH_OPTS[@]}" root@"$ip" "$@" ;;
  env) printf 'KIT_DIR=%q\nVARIANT=%q\nBASE=%q\nSTATE=%q\nSSH_KEY=%q\nMODE=%q\nHUB=%q\nBR=%q\nBRIDGE_MAC=%q\nNET=%q\nSHARED_ROOT=%q\n' \
         "$KIT_DIR" "$VARIANT" "$BASE" "$STATE" "$SSH_KEY" "$MODE" "$HUB" "$BR" "$BRIDGE_MAC" "$NET" "$KIT_DIR/shared" ;;
  *) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; [ "$cmd" = help ]; exit ;;
esac
