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
cd "$dir"
apt-get download "$@"
ls "$dir"/*.deb
