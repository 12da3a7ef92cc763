#!/bin/sh
# Download Debian's haproxy and the packages a host lacks into DIR, for hosts without a package
# mirror (set epd_haproxy_deb_dir: DIR). Run on a machine with apt access and the hosts' release:
#   roles/epd_haproxy/files/fetch-debs.sh DIR [PACKAGE...]
# Without PACKAGEs: haproxy and its direct dependencies that a minimal Debian 12 lacks.
set -eu
dir=${1:?usage: fetch-debs.sh DIR [PACKAGE...]}
shift
[ "$#" -gt 0 ] || set -- haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1 lsb-base
mkdir -p "$dir"
# apt downloads as its unprivileged _apt user where there is one (else it warns and downloads as root)
if id _apt >/dev/null 2>&1; then chown _apt "$dir"; fi
cd "$dir"
apt-get download "$@"
ls "$dir"/*.deb
