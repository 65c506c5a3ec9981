#!/usr/bin/env bash
# Build Forage's GPU image (deploy/Dockerfile, target gpu) on a machine with no registry and no
# package index, in two steps on two machines:
#   fetch   (a machine with Docker, PyPI, FlashInfer's indexes and Ubuntu's mirror) fills
#           deploy/wheelhouse-gpu/ with everything the gpu stage installs:
#             - the wheels of deploy/gpu-requirements.txt (pip download --no-deps, the image's
#               Python 3.12 and platform; sdists such as DeepSpeed's are built into wheels);
#             - FlashInfer's kernel wheels of deploy/gpu-kernels.txt (the JIT-cache shim brings
#               its provider wheels, one per GPU architecture);
#             - debs/: the .debs of the gpu stage's `apt-get install` line and what they need,
#               downloaded inside the base image itself (apt-get install --download-only);
#             - base-image.tar: the nvidia/cuda base (docker save).
#           Then it checks, offline and in the base image, that pip finds every pin there.
#   build   (the air-gapped machine, after copying deploy/wheelhouse-gpu/ there): loads the base
#           from base-image.tar when the engine lacks it, then
#           docker build --network=none --build-arg WHEELHOUSE=1 --target gpu.
# fetch writes deploy/wheelhouse-gpu/.complete, a hash of the lock, the kernel pins and the
# Dockerfile; build refuses a wheelhouse whose hash differs (fetch again).
#
# Usage: deploy/build-offline-gpu.sh fetch
#        deploy/build-offline-gpu.sh build [IMAGE]      # default forage:gpu
#        deploy/build-offline-gpu.sh plan               # print the base and the apt packages
# Environment: PYTHON (the Python whose pip downloads; default .venv/bin/python, python3),
#   DOCKER (the docker CLI; it must build with BuildKit), GPU_WHEELHOUSE (default
#   deploy/wheelhouse-gpu), FETCH_NETWORK (fetch: the --network of the container that downloads
#   the .debs, e.g. host for an engine without a default bridge),
#   FLASHINFER_KERNELS=0 (fetch and build: leave FlashInfer's kernel wheels out, for a test
#   build where FlashInfer's indexes cannot be reached; such an image lacks its prebuilt kernels,
#   is labelled ai.forage.flashinfer-kernels=0, and must not be shipped).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELHOUSE=${GPU_WHEELHOUSE:-$REPO/deploy/wheelhouse-gpu}
DOCKERFILE=$REPO/deploy/Dockerfile
LOCK=$REPO/deploy/gpu-requirements.txt
KERNELS=$REPO/deploy/gpu-kernels.txt
log() { printf '[build-offline-gpu %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }
usage() { sed -n '/^# Usage:/,/^#   deploy\/wheelhouse-gpu)/p' "$0" | sed 's/^# \{0,1\}//' >&2; }

case ${1:-} in
    fetch|plan) [ $# -eq 1 ] || { usage; exit 2; } ;;
    build) [ $# -le 2 ] || { usage; exit 2; } ;;
    -h|--help) usage; exit 0 ;;
    *) log "error: unknown step '${1:-}' (fetch, build or plan)"; usage; exit 2 ;;
esac
STEP=$1
IMAGE=${2:-forage:gpu}

# The gpu stage's base image and apt packages, read from the Dockerfile (one source).
BASE=$(awk 'toupper($1) == "FROM" && toupper($3) == "AS" && $4 == "gpu" {print $2}' "$DOCKERFILE")
[ -n "$BASE" ] || die "no 'FROM ... AS gpu' in deploy/Dockerfile"
GPU_APT=$(sed -n '/^FROM .* AS gpu/,$p' "$DOCKERFILE" \
    | sed -e ':a' -e '/\\$/N; s/\\\n//; ta' | grep -o 'apt-get install[^&;|]*' \
    | tr -s ' \t' '\n' | grep -v -E '^(apt-get|install|-.*|/.*|)$' | sort -u | tr '\n' ' ' || true)
[ -n "$GPU_APT" ] || die "no apt-get install of packages in deploy/Dockerfile's gpu stage"
KERNELS_ON=${FLASHINFER_KERNELS:-1}
[[ $KERNELS_ON = [01] ]] || die "FLASHINFER_KERNELS is 0 or 1, not '$KERNELS_ON'"
stamp() { { cat "$LOCK" "$KERNELS" "$DOCKERFILE"; echo "kernels=$KERNELS_ON"; } \
    | sha256sum | cut -c1-16; }
if [ "$STEP" = plan ]; then
    printf 'base: %s\napt: %s\nwheelhouse: %s\n' "$BASE" "${GPU_APT% }" "$WHEELHOUSE"
    exit 0
fi

if [ "$STEP" = build ]; then
    [ "$(cat "$WHEELHOUSE/.complete" 2>/dev/null)" = "$(stamp)" ] \
        || die "$WHEELHOUSE is not filled for this lock, Dockerfile and FLASHINFER_KERNELS=$KERNELS_ON: run \`deploy/build-offline-gpu.sh fetch\` on a connected machine and copy the folder here"
fi

DOCKER=${DOCKER:-docker}
command -v "$DOCKER" >/dev/null || die "no docker CLI ($DOCKER)"
"$DOCKER" buildx version >/dev/null 2>&1 || [ -n "${DOCKER_BUILDKIT:-}" ] \
    || die "$DOCKER cannot build with BuildKit (install the buildx plugin, or DOCKER_BUILDKIT=1 on a 20.10-22.x client)"
export DOCKER_BUILDKIT=1

if [ "$STEP" = build ]; then
    if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
        [ -s "$WHEELHOUSE/base-image.tar" ] || die "$BASE is not in the engine and $WHEELHOUSE/base-image.tar is missing"
        log "base: docker load < $WHEELHOUSE/base-image.tar"
        "$DOCKER" load -i "$WHEELHOUSE/base-image.tar" >/dev/null
    fi
    log "image: $IMAGE (docker build --network=none --build-arg WHEELHOUSE=1 --target gpu)"
    SECONDS=0
    GPU_WHEELHOUSE_REL=${WHEELHOUSE#"$REPO"/}
    [ "$GPU_WHEELHOUSE_REL" = deploy/wheelhouse-gpu ] \
        || die "the build mounts deploy/wheelhouse-gpu: copy $WHEELHOUSE there"
    [ "$KERNELS_ON" = 1 ] || log "WITHOUT FlashInfer's kernel wheels (FLASHINFER_KERNELS=0): a test image, not for use"
    "$DOCKER" build --network=none --build-arg WHEELHOUSE=1 \
        --build-arg FLASHINFER_KERNELS="$KERNELS_ON" -f "$DOCKERFILE" --target gpu \
        -t "$IMAGE" "$REPO"
    log "image: $IMAGE built in ${SECONDS}s"
    exit 0
fi

# ---------------------------------------------------------------- fetch
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
TARGET=$("$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv[1]); import gpu_lock
print(" ".join(gpu_lock.target_options()))' "$REPO/deploy")
mkdir -p "$WHEELHOUSE/debs"
rm -f "$WHEELHOUSE/.complete"
pip=("$PYTHON" -m pip --isolated --disable-pip-version-check)

log "base: $BASE"
"$DOCKER" image inspect "$BASE" >/dev/null 2>&1 || "$DOCKER" pull "$BASE"
"$DOCKER" save -o "$WHEELHOUSE/base-image.tar" "$BASE"

log "debs: $GPU_APT"
# shellcheck disable=SC2086
"$DOCKER" run --rm ${FETCH_NETWORK:+--network "$FETCH_NETWORK"} -v "$WHEELHOUSE/debs:/debs" \
    "$BASE" sh -c "apt-get update -q \
    && apt-get install -y -q --download-only --no-install-recommends $GPU_APT \
    && cp /var/cache/apt/archives/*.deb /debs/"

log "wheels: $(grep -c '==' "$LOCK") pins of ${LOCK#"$REPO"/}"
# --no-deps: the lock is the whole set (and pip then accepts the sdists the lock's header names,
# built into wheels below).
SDISTS=$(sed -n 's/^# No wheel on PyPI, built from the sdist: //p' "$LOCK" | tr -d ' ')
# shellcheck disable=SC2086
"${pip[@]}" download -q --no-deps -d "$WHEELHOUSE" --index-url https://pypi.org/simple \
    $TARGET ${SDISTS:+--no-binary="$SDISTS"} -r "$LOCK"
for sdist in "$WHEELHOUSE"/*.tar.gz "$WHEELHOUSE"/*.zip; do
    [ -e "$sdist" ] || continue
    log "wheels: building a wheel of ${sdist##*/}"
    "${pip[@]}" wheel -q --no-deps -w "$WHEELHOUSE" "$sdist"
    rm -f "$sdist"
done
if [ "$KERNELS_ON" = 1 ]; then
    log "wheels: FlashInfer's kernels (${KERNELS#"$REPO"/})"
    # shellcheck disable=SC2086
    "${pip[@]}" download -q -d "$WHEELHOUSE" --find-links "$WHEELHOUSE" $TARGET -r "$KERNELS"
else
    log "wheels: FlashInfer's kernels LEFT OUT (FLASHINFER_KERNELS=0)"
fi

log "check: pip in $BASE installs every pin from $WHEELHOUSE, offline"
"$DOCKER" run --rm --network none -v "$WHEELHOUSE:/wheelhouse:ro" -v "$REPO/deploy:/deploy:ro" \
    "$BASE" sh -c "apt-get install -y -q --no-install-recommends /wheelhouse/debs/*.deb >/dev/null \
    && python3.12 -m venv /tmp/v && /tmp/v/bin/pip install -q --dry-run --no-index \
    --find-links /wheelhouse -r /deploy/gpu-requirements.txt$([ "$KERNELS_ON" = 0 ] || echo ' -r /deploy/gpu-kernels.txt')" \
    || die "the base image cannot install the lock from $WHEELHOUSE offline (above)"
stamp >"$WHEELHOUSE/.complete"
log "done: $(find "$WHEELHOUSE" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(find "$WHEELHOUSE/debs" -name '*.deb' | wc -l) .debs, $(du -sh "$WHEELHOUSE" | cut -f1); copy $WHEELHOUSE to the air-gapped machine and run: deploy/build-offline-gpu.sh build"
