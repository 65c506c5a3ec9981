#!/usr/bin/env bash
# The GPU check, as one command: bench/gpu/run.sh [--dry-run] [--parts a,b] [--budget-s N]
#
# On a machine with one NVIDIA GPU, PyTorch and transformers (no internet, no vLLM, none of
# Forage's other dependencies), it installs the wheels carried in bench/gpu/wheelhouse (made by
# `make gpu-wheelhouse`) into a folder of its own, then runs the six default parts (real_learn
# too when --parts names it: bench/README.md, "Does it learn?") under a time budget
# and writes one JSON file per part (plan_check's goes into learner.json), summary.json,
# summary.md and run.log to $OUT (a temporary folder when $OUT is unset). --dry-run runs the
# same code at toy sizes on the CPU with the Python environment as it is (nothing installed).
# bench/README.md, "GPU check", says more.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DRY=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY=1; done
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/forage-gpu-out.XXXXXX")}"
mkdir -p "$OUT"
export OUT
if [ -n "${PYTHON:-}" ]; then :
elif [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"
else PYTHON=python3
fi
SITE="${FORAGE_GPU_SITE:-/tmp/forage-gpu/site}"
WHEELHOUSE="$HERE/wheelhouse"
if [ "$DRY" = 0 ] && compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
    echo "installing the carried wheels into $SITE"
    started=$(date +%s)
    mkdir -p "$SITE"
    # --no-deps: wheels.txt names every package the image lacks; --no-build-isolation: the
    # DeepSpeed source distribution builds against the torch already installed, offline.
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
            --disable-pip-version-check --upgrade --target "$SITE" \
            "$WHEELHOUSE"/*.whl $(compgen -G "$WHEELHOUSE/*.tar.gz") >>"$OUT/run.log" 2>&1; then
        echo "installing the wheels failed (tail of $OUT/run.log below); the parts run anyway"
        tail -20 "$OUT/run.log"
    fi
    echo "installed in $(( $(date +%s) - started ))s"
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export FORAGE_GPU_SITE="$SITE"
cd "$REPO"
exec "$PYTHON" "$HERE/run.py" --out "$OUT" --site "$SITE" "$@"
