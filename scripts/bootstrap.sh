#!/bin/bash
# Install what the kit's controller side, its tests and the sandbox need, from nothing,
# idempotently (a second run takes about a second):
#   - Debian packages: systemd-nspawn (systemd-container), mmdebstrap + eatmydata (rootfs
#     of the test hosts), ssh client, iproute2, python3-venv;
#   - the Python venv .venv with the kit, its test extras and the bench extras the bench smoke
#     tests need (`pip install -e '.[test,bench]'`), from wheels built once per pyproject.toml
#     into $KIT_DIR (/var/tmp/epd-kit), reinstalled only when pyproject.toml changed (stamp
#     .venv/.bootstrap-stamp): a copy of the venv built (and its bytecode written) once per
#     pyproject.toml on this machine ($KIT_DIR/venv-<hash>), with this checkout's kit installed
#     editable into the copy.
# Run as root on Debian 12.
set -euo pipefail
cd "$(dirname "$0")/.."
# needs root (apt-get): as root it runs as is; otherwise through sudo where there is one
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "bootstrap.sh: needs root (apt-get); run it as root" >&2; exit 1; }
  exec sudo -E "$0" "$@"
fi
[ -r /etc/debian_version ] || { echo "bootstrap.sh: needs Debian 12 (apt, systemd 252)" >&2; exit 1; }

APT_PKGS=(systemd-container mmdebstrap eatmydata openssh-client iproute2 util-linux procps
          python3 python3-venv ca-certificates prometheus
          dpkg-dev gpg gcc)   # dpkg-dev, gpg: the provisioning stand-ins (a signed local apt repository);
                              # gcc: their stub libfabric/libcuda/libcudart (tests/hosts/standins)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

VENV=.venv
STAMP=$VENV/.bootstrap-stamp
EXTRAS=test,bench
want=$( (python3 --version; cat pyproject.toml; echo "$EXTRAS") | sha256sum | cut -c1-16)
# Every checkout on this machine installs the same wheels: they are built once per `want` into
# the kit's cache (a fresh clone then installs offline in ~30 s instead of resolving and
# downloading ~100 packages again). The venv's bytecode is written here, once, in parallel
# (compileall -j0; pip's own compile step is serial), never left to the first import: where
# PYTHONDONTWRITEBYTECODE is set (as on the machines this project is tested on) Python never writes
# it, and every pytest, ansible-playbook and router/sim process would compile its imports again
# (docs/sandbox.md: the host-free lane took 567 CPU-s without the venv's bytecode, 406 with it).
WHEELS=${KIT_DIR:-/var/tmp/epd-kit}/pip-wheels-$want
# The venv itself is built once per `want` too ($TEMPLATE: every package installed and its bytecode
# written) and each checkout copies it: ~4 CPU-s (the copy, its paths and this checkout's kit
# installed editable) instead of ~42 (pip's install of ~100 wheels, then compileall), on the
# critical path of every fresh clone's test run (docs/sandbox.md "What a fresh clone ... repeats").
# A venv is relocatable but for the absolute paths venv and pip write: the console scripts'
# shebangs and the activate scripts, rewritten below; the bytecode names its source path, which
# the import system corrects when it loads it (importlib's _fix_co_filename).
TEMPLATE=${KIT_DIR:-/var/tmp/epd-kit}/venv-$want
PIP=(--disable-pip-version-check -q)
if [ "$(cat $STAMP 2>/dev/null)" != "$want compiled" ]; then
  mkdir -p "$(dirname "$WHEELS")"
  case $TEMPLATE in /*) ;; *) TEMPLATE=$PWD/$TEMPLATE ;; esac   # the paths rewritten below are absolute
  exec 9>"$WHEELS.lock"
  flock 9   # one builder at a time (two checkouts bootstrapping at once)
  if [ ! -f "$WHEELS/.complete" ]; then
    echo "bootstrap: pip wheel '.[$EXTRAS]' and the build backend into $WHEELS (once per pyproject.toml)"
    rm -rf "$WHEELS.tmp" && mkdir -p "$WHEELS.tmp"
    [ -x $VENV/bin/python ] || python3 -m venv $VENV   # pip to build them with (replaced below)
    $VENV/bin/pip wheel "${PIP[@]}" --wheel-dir "$WHEELS.tmp" ".[$EXTRAS]"
    rm -f "$WHEELS.tmp"/epd_kit-*.whl   # the kit itself installs editable from this checkout
    backend=$($VENV/bin/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"])')
    # shellcheck disable=SC2086  # one argument per requirement
    $VENV/bin/pip download "${PIP[@]}" --only-binary :all: --dest "$WHEELS.tmp" $backend
    touch "$WHEELS.tmp/.complete"
    rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
    find "$(dirname "$WHEELS")" -maxdepth 1 -name 'pip-wheels-*' ! -name "pip-wheels-$want*" -exec rm -rf {} +
    # the venvs of other pyproject.tomls, unless a bootstrap of theirs holds their lock right now
    for old in "$(dirname "$WHEELS")"/venv-*; do
      [ -d "$old" ] && [ "$old" != "$TEMPLATE" ] || continue
      flock -n "$(dirname "$WHEELS")/pip-wheels-${old##*/venv-}.lock" rm -rf "$old" || true
    done
  fi
  if [ ! -f "$TEMPLATE/.complete" ]; then
    echo "bootstrap: pip install '.[$EXTRAS]' into $TEMPLATE (offline, from $WHEELS; once per pyproject.toml)"
    rm -rf "$TEMPLATE" && python3 -m venv "$TEMPLATE"
    "$TEMPLATE/bin/pip" install "${PIP[@]}" --no-compile --no-index --find-links "$WHEELS" -e ".[$EXTRAS]"
    # a file that is not Python 3 (a package's test data or template) fails to compile and stays
    # source (the two counts below tell), never a failure
    site=$("$TEMPLATE/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    "$TEMPLATE/bin/python" -m compileall -q -j0 "$site" >/dev/null 2>&1 || true
    echo "bootstrap: bytecode written ($(find "$site" -name '*.py' | wc -l) modules, $(find "$site" -name '*.pyc' | wc -l) compiled)"
    touch "$TEMPLATE/.complete"
  fi
  echo "bootstrap: $VENV copied from $TEMPLATE, this checkout's kit installed editable"
  rm -rf "$VENV.new"
  cp -a "$TEMPLATE" "$VENV.new"   # under the lock: a builder never replaces it mid-copy
  exec 9>&-
  rm -f "$VENV.new/.complete"
  here=$(pwd -P)/$VENV
  # the absolute paths: the console scripts' shebangs (text files only: ruff is a binary), activate*
  grep -lZ -m1 "^#!$TEMPLATE/bin/" "$VENV.new"/bin/* 2>/dev/null | xargs -0 -r sed -i "1s|^#!$TEMPLATE/bin/|#!$here/bin/|"
  sed -i "s|$TEMPLATE|$here|g" "$VENV.new"/bin/activate* "$VENV.new/pyvenv.cfg"
  if stale=$(grep -l --binary-files=without-match "$TEMPLATE" "$VENV.new"/bin/*); then
    echo "bootstrap: $VENV.new still names $TEMPLATE in: $stale (a shebang this script does not rewrite); remove $TEMPLATE and run again" >&2
    exit 1
  fi
  rm -rf $VENV && mv "$VENV.new" $VENV
  # the template's kit is the checkout that built it: this one's, editable (its console scripts too)
  $VENV/bin/pip install "${PIP[@]}" --no-compile --no-index --find-links "$WHEELS" --no-deps -e .
  echo "$want compiled" > $STAMP
fi
# This checkout's own Python (the editable kit, the collection's plugins) gets its bytecode too: the
# venv's is written above, but where PYTHONDONTWRITEBYTECODE is set every ansible-playbook, pytest,
# router and sim process compiled epd_kit from source again (importing epd_kit.plan: 0.2 CPU-s from
# source, 0.1 from bytecode). Every run, not once: compileall writes only what changed since (a
# source newer than its bytecode is recompiled at import anyway, so a stale file is never used).
$VENV/bin/python -m compileall -q -j0 router plugins >/dev/null
echo "bootstrap: ok ($VENV, $(.venv/bin/ansible-playbook --version | sed -n 1p))"
