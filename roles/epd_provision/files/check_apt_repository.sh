#!/bin/bash
# Check apt repositories and the packages in them WITHOUT touching the host's apt configuration:
# `apt-get update` of only the given sources list into a work directory (each signature checked
# with the key its line names in signed-by, or with the keys in WORK_DIR/trusted.gpg.d, never the
# host's), then look each package up there.
#   check_apt_repository.sh WORK_DIR SOURCES_LIST PACKAGE[=VERSION] ...
# Prints one PACKAGE=FULL_VERSION line per package (the exact version to install: the pin or the
# pin's upstream part, e.g. 2.24.7.0 -> 2.24.7.0-dcd0b2d2d; without a pin the newest); exit 1
# with the reason otherwise.
set -uo pipefail
work=$1 sources=$2; shift 2
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/trusted.gpg.d"
apt_opts=(-o "Dir::Etc::SourceList=$sources" -o "Dir::Etc::SourceParts=$work/none"
          -o "Dir::Etc::Trusted=$work/none.gpg" -o "Dir::Etc::TrustedParts=$work/trusted.gpg.d"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "Acquire::Retries=0")
where=$(grep -E '^[[:space:]]*deb[[:space:]]' "$sources" | sed -E 's/^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' | paste -sd';')
if ! out=$(apt-get "${apt_opts[@]}" --error-on=any update 2>&1); then
  echo "apt-get update of '$where' failed:"
  echo "$out" | grep -E '^(E|W|Err):' | head -5
  exit 1
fi
missing=()
for pin in "$@"; do
  package=${pin%%=*} version=${pin#*=}
  [ "$version" != "$pin" ] || version=""
  found=$(apt-cache "${apt_opts[@]}" madison "$package" 2>/dev/null | awk -F'|' '{gsub(/ /, "", $2); print $2}' |
          awk -v v="$version" 'v == "" || $0 == v || index($0, v "-") == 1 { print; exit }')
  if [ -n "$found" ]; then echo "$package=$found"; else missing+=("$package ${version:-(any version)}"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "not in $where: ${missing[*]}"
  exit 1
fi
