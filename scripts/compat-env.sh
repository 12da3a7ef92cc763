#!/usr/bin/env bash
# The vLLM-compat environment: a venv with vLLM 0.24.0 and its pinned torch (CPU only, no
# triton), built from tests/compat/requirements.txt and cached; see docs/compat.md.
#
#   scripts/compat-env.sh                  build it if missing, print its path
#   scripts/compat-env.sh pytest [ARGS]    ... then run pytest in it (default: tests/compat)
#   scripts/compat-env.sh --path           print where it is (or would be), build nothing
#   scripts/compat-env.sh --ready          exit 0 if it is built (CI: run the tier when warm)
#
# Cache: $EPD_COMPAT_CACHE (default /var/tmp/epd-kit/vllm-compat)/<key>, key = hash of the
# requirements file and the interpreter. A stamp is written only after a build passed its
# import check; a flock serialises concurrent runs. Uses the machine's pip configuration.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQUIREMENTS=$REPO/tests/compat/requirements.txt
PYTHON=${EPD_COMPAT_PYTHON:-python3}
CACHE=${EPD_COMPAT_CACHE:-/var/tmp/epd-kit/vllm-compat}

key() {
    { cat "$REQUIREMENTS"; "$PYTHON" -c 'import platform, sys; print(sys.version, platform.machine())'; } \
        | sha256sum | cut -c1-12
}

ENV_DIR=$CACHE/$(key)
STAMP=$ENV_DIR/.epd-compat-ok

# vLLM runs here on the CPU platform with nothing in the engine core; the smoke test imports
# what the tier imports, so a broken env never gets a stamp.
SMOKE='
import torch, torchvision, vllm
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.serve.disagg.mm_serde import decode_mm_kwargs_item
assert vllm.__version__ == "0.24.0", vllm.__version__
print(f"vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}")
'

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

build() {
    local started
    started=$(now)
    echo "compat-env: building $ENV_DIR (one-off, several GB from PyPI)" >&2
    rm -rf "$ENV_DIR"  # a build that died half way left no stamp: start over
    "$PYTHON" -m venv "$ENV_DIR"
    "$ENV_DIR/bin/python" -m pip install --quiet --no-deps --no-input -r "$REQUIREMENTS"
    (cd / && HF_HUB_OFFLINE=1 "$ENV_DIR/bin/python" -W ignore -c "$SMOKE") >&2
    touch "$STAMP"
    echo "compat-env: built in $(since "$started") s, $(du -sh "$ENV_DIR" | cut -f1) on disk" >&2
}

ensure() {
    local started
    started=$(now)
    mkdir -p "$CACHE"
    exec 9>"$ENV_DIR.lock"
    flock 9
    if [[ -f $STAMP ]]; then
        echo "compat-env: cached $ENV_DIR (checked in $(since "$started") s)" >&2
    else
        build
    fi
    flock -u 9
    exec 9>&-
}

case ${1:-} in
    --path)
        echo "$ENV_DIR"
        ;;
    --ready)
        [[ -f $STAMP ]]
        ;;
    pytest)
        shift
        ensure
        cd "$REPO"
        exec "$ENV_DIR/bin/python" -m pytest "${@:-tests/compat}"
        ;;
    "")
        ensure
        echo "$ENV_DIR"
        ;;
    *)
        echo "usage: $0 [--path | --ready | pytest [ARGS...]]" >&2
        exit 2
        ;;
esac
