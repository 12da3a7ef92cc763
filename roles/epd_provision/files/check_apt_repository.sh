#!/bin/bash
# Check an apt repository and the pinned versions in it WITHOUT touching the host's apt
# configuration: `apt-get update` against only that repository into a scratch directory
# (signature checked with the given key), then look each pin up there.
#   check_apt_repository.sh SCRATCH_DIR KEY_FILE URL SUITE PACKAGE=VERSION ...
# Prints one PACKAGE=FULL_VERSION line per pin (the exact version to install: the pin or the
# pin's upstream part, e.g. 2.24.7.0 -> 2.24.7.0-dcd0b2d2d); exit 1 with the reason otherwise.
set -uo pipefail
scratch=$1 key=$2 url=$3 suite=$4; shift 4
mkdir -p "$scratch/lists/partial" "$scratch/cache/archives/partial"
echo "deb [signed-by=$key] $url $suite main" > "$scratch/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$scratch/sources.list" -o "Dir::Etc::SourceParts=$scratch/none"
          -o "Dir::State::Lists=$scratch/lists" -o "Dir::Cache=$scratch/cache" -o "Acquire::Retries=0")
if ! out=$(apt-get "${apt_opts[@]}" --error-on=any update 2>&1); then
  echo "apt-get update of '$url $suite main' (key $key) failed:"
  echo "$out" | grep -E '^(E|W|Err):' | head -5
  exit 1
fi
missing=()
for pin in "$@"; do
  package=${pin%%=*} version=${pin#*=}
  found=$(apt-cache "${apt_opts[@]}" madison "$package" 2>/dev/null | awk -F'|' '{gsub(/ /, "", $2); print $2}' |
          awk -v v="$version" '$0 == v || index($0, v "-") == 1 { print; exit }')
  if [ -n "$found" ]; then echo "$package=$found"; else missing+=("$package $version"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "not in $url $suite: ${missing[*]}"
  exit 1
fi
