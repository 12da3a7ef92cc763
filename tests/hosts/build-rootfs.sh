#!/bin/bash
# Build the shared, read-only base rootfs of the test hosts. The default variant plays the
# trn2 DLAMI: python3 with venv, libfabric, curl, sshd, systemd; nothing of the kit (the deploy
# playbook installs the kit, exactly as on a real host). The variant "bare" plays a hardened
# image of a fleet's own: the same without what the DLAMI brings and playbooks/provision.yml
# installs (libfabric; docs/provisioning.md).
#   usage: build-rootfs.sh ROOTFS_DIR [dlami|bare]
# Concurrent callers build once (flock on ROOTFS_DIR.lock); the tree is built in
# ROOTFS_DIR.tmp and renamed, so a half-built tree is never used. The caller keys
# ROOTFS_DIR by a hash of this file, so changing the package list means a new rootfs.
set -euo pipefail
ROOT=${1:?usage: build-rootfs.sh ROOTFS_DIR [dlami|bare]}
VARIANT=${2:-dlami}
# nftables: Ubuntu's server images (the DLAMI's base) ship nft; the kit's access rules load with it
# (roles/epd_firewall installs it from the host's repositories where it is missing; these hosts have none)
PKGS=systemd,systemd-sysv,dbus,python3,python3-venv,curl,ca-certificates,openssh-server,iproute2,procps,sudo,nftables
case "$VARIANT" in
  dlami) PKGS=$PKGS,libfabric1 ;;
  bare) ;;
  *) echo "build-rootfs.sh: unknown variant '$VARIANT' (dlami or bare)" >&2; exit 2 ;;
esac
# kitops: a normal login with password-less sudo, for deploying as a non-root ansible_user
OPS_USER=kitops
SRC=/etc/apt/sources.list.d/debian.sources   # the machine's own apt sources (deb822)

ready() { [ -x "$ROOT/lib/systemd/systemd" ]; }
ready && { echo "rootfs cached: $ROOT"; exit 0; }

mkdir -p "$(dirname "$ROOT")"
exec 9>"$ROOT.lock"
flock 9                                       # another caller may be building right now
ready && { echo "rootfs cached: $ROOT (built by a concurrent caller)"; exit 0; }

R=$ROOT.tmp
rm -rf "$R"                                   # leftover of an interrupted build
trap 'rm -rf "$R"' EXIT
if command -v mmdebstrap >/dev/null; then
  # 40-55 s; the eatmydata hook skips fsync (dpkg is fsync-bound)
  mmdebstrap --quiet --variant=minbase --include=$PKGS \
    --hook-dir=/usr/share/mmdebstrap/hooks/eatmydata \
    bookworm "$R" "$SRC"
else
  debootstrap --variant=minbase --include=$PKGS bookworm "$R" \
    "$(awk '/^URIs:/{print $2; exit}' "$SRC")"
fi
chroot "$R" ssh-keygen -A >/dev/null                   # mmdebstrap leaves no host keys
chroot "$R" systemctl enable systemd-networkd >/dev/null 2>&1
chroot "$R" useradd --create-home --shell /bin/bash "$OPS_USER"
echo "$OPS_USER ALL=(ALL:ALL) NOPASSWD: ALL" > "$R/etc/sudoers.d/$OPS_USER"
chmod 0440 "$R/etc/sudoers.d/$OPS_USER"
# nothing in the guests may try to reach the outside: no apt timers, no DNS
chroot "$R" systemctl mask apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer \
  e2scrub_all.timer fstrim.timer console-getty.service getty@.service >/dev/null 2>&1
echo 'nameserver 127.0.0.1' > "$R/etc/resolv.conf"
rm -f "$R/etc/hostname"; : > "$R/etc/machine-id"       # per-host identity at first boot
rm -rf "$R/var/cache/apt/archives/"*.deb "$R/var/lib/apt/lists/"* 2>/dev/null || true
mv "$R" "$ROOT"
trap - EXIT
echo "rootfs built: $ROOT ($VARIANT)"
