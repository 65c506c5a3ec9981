#!/usr/bin/env bash
# A local stand-in for the GPU image's base (deploy/Dockerfile's `FROM nvidia/cuda:... AS gpu`)
# on a machine that reaches Ubuntu's package mirror and PyPI but no container registry, so that
# the gpu target builds unchanged (deploy/build-offline-gpu.sh). It gets the SAME name and tag
# as NVIDIA's image and carries ENV FORAGE_LOCAL_STAND_IN=1 (docker image inspect tells them
# apart). What it holds, against the real nvidia/cuda:X.Y.Z-runtime-ubuntu24.04:
#   - the OS: debootstrap --variant=minbase of Ubuntu 24.04 (noble) from Ubuntu's mirror, with
#     ca-certificates and gnupg, Ubuntu's apt sources (ubuntu.sources, as in ubuntu:24.04) and
#     user `ubuntu` as uid 1000 (as in ubuntu:24.04). The archive's signature is checked with
#     Ubuntu's keyring, taken from ubuntu-keyring's .deb (sha256 and key fingerprint pinned).
#   - the CUDA runtime: libcudart.so.13 under /usr/local/cuda-X.Y (symlinks /usr/local/cuda,
#     /usr/local/cuda-X), registered with ldconfig, from PyPI's nvidia-cuda-runtime wheel at the
#     version deploy/gpu-requirements.txt pins (NVIDIA's apt repository is not reachable here).
#   - NVIDIA's environment: NVIDIA_REQUIRE_CUDA=cuda>=X.Y, NVIDIA_VISIBLE_DEVICES=all,
#     NVIDIA_DRIVER_CAPABILITIES=compute,utility, CUDA_VERSION, PATH with /usr/local/cuda/bin
#     and /usr/local/nvidia/bin, LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64.
# Left out (the image does not use them: torch, vLLM and FAISS load the CUDA libraries of the
# lock's nvidia-* wheels): the runtime flavour's cuda-libraries (cuBLAS, cuFFT, cuRAND,
# cuSOLVER, cuSPARSE, NPP, nvJPEG, NVRTC, nvJitLink), NVTX, libnccl2, cuda-compat, NVIDIA's apt
# source and its entrypoint script. So the stand-in is smaller than the real base.
#
# Idempotent: an image of that name (stand-in or real) is left alone. The finished root
# filesystem is cached as $FORAGE_IMAGE_CACHE/rootfs-cuda-KEY.tar (KEY hashes this script and
# the base's name): later runs only `docker import` it.
#
# Usage (root; debootstrap, a docker CLI whose DOCKER_HOST names the engine):
#   deploy/local-gpu-base-image.sh
# Environment: FORAGE_IMAGE_CACHE (default /var/cache/forage-base-images), UBUNTU_MIRROR
#   (default http://archive.ubuntu.com/ubuntu), PYTHON (pip for the CUDA runtime wheel),
#   GPU_WHEELHOUSE (looked in first for that wheel; default deploy/wheelhouse-gpu), DOCKER.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SCRIPT="$REPO/deploy/local-gpu-base-image.sh"
CACHE=${FORAGE_IMAGE_CACHE:-/var/cache/forage-base-images}
MIRROR=${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}
WHEELHOUSE=${GPU_WHEELHOUSE:-$REPO/deploy/wheelhouse-gpu}
DOCKER=${DOCKER:-docker}
# Ubuntu's archive keyring: ubuntu-keyring 2023.11.28.1 (noble), and the key that signs noble.
KEYRING_DEB=pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb
KEYRING_SHA256=36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8
ARCHIVE_KEY=F6ECB3762474EDA9D21B7022871920D1991BC93C

log() { printf '[local-gpu-base-image %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (debootstrap and chroot need it)"
command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
command -v "$DOCKER" >/dev/null || die "docker CLI not found ($DOCKER)"
"$DOCKER" version >/dev/null || die "no docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unset})"

BASE=$(awk 'toupper($1) == "FROM" && toupper($3) == "AS" && $4 == "gpu" {print $2}' \
    "$REPO/deploy/Dockerfile")
[[ $BASE =~ ^nvidia/cuda:(([0-9]+)\.([0-9]+))\.[0-9]+-runtime-ubuntu24\.04$ ]] \
    || die "the gpu stage's base '$BASE' is not nvidia/cuda:X.Y.Z-runtime-ubuntu24.04: no stand-in for it"
CUDA_XY=${BASH_REMATCH[1]} CUDA_X=${BASH_REMATCH[2]}
CUDA_VERSION=${BASE#nvidia/cuda:}; CUDA_VERSION=${CUDA_VERSION%%-*}
CUDART=$(sed -n 's/^nvidia-cuda-runtime==//p' "$REPO/deploy/gpu-requirements.txt")
[ -n "$CUDART" ] || die "deploy/gpu-requirements.txt pins no nvidia-cuda-runtime"
[ "${CUDART%%.*}" = "$CUDA_X" ] || die "nvidia-cuda-runtime $CUDART is not CUDA $CUDA_X"

if "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
    log "$BASE exists, skipped"
    exit 0
fi
mkdir -p "$CACHE"
WORK=$(mktemp -d /tmp/forage-gpu-base.XXXXXX)
ROOT=$WORK/root
cleanup() {
    for m in proc sys dev; do mountpoint -q "$ROOT/$m" 2>/dev/null && umount -l "$ROOT/$m"; done
    rm -rf "$WORK"
}
trap cleanup EXIT
SECONDS=0

in_root() {  # in_root CMD...: run in the chroot with /proc, /sys and /dev
    mount -t proc proc "$ROOT/proc"
    mount --rbind /sys "$ROOT/sys" && mount --make-rslave "$ROOT/sys"
    mount --rbind /dev "$ROOT/dev" && mount --make-rslave "$ROOT/dev"
    local rc=0
    chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 HOME=/root \
        "$@" || rc=$?
    umount -l "$ROOT/dev" "$ROOT/sys" "$ROOT/proc"
    return $rc
}

ubuntu_keyring() {  # the archive keyring, checked against the pinned hash and fingerprint
    curl -fsS --retry 3 -o "$WORK/keyring.deb" "$MIRROR/$KEYRING_DEB" \
        || die "cannot download $MIRROR/$KEYRING_DEB"
    echo "$KEYRING_SHA256  $WORK/keyring.deb" | sha256sum -c --quiet - \
        || die "ubuntu-keyring's .deb does not have the pinned sha256"
    dpkg-deb -x "$WORK/keyring.deb" "$WORK/keyring"
    KEYRING=$WORK/keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg
    gpg --homedir "$WORK" --show-keys --with-colons "$KEYRING" 2>/dev/null \
        | grep -q "^fpr:::::::::$ARCHIVE_KEY:" || die "no key $ARCHIVE_KEY in Ubuntu's keyring"
}

cudart_wheel() {  # the nvidia-cuda-runtime wheel the lock pins: the wheelhouse's, or PyPI's
    local wheel
    wheel=$(find "$WHEELHOUSE" -maxdepth 1 -name "nvidia_cuda_runtime-$CUDART-*.whl" | head -1)
    if [ -z "$wheel" ]; then
        local python=${PYTHON:-$REPO/.venv/bin/python}
        [ -x "$python" ] || python=python3
        "$python" -m pip --isolated --disable-pip-version-check download -q --no-deps \
            --only-binary=:all: --platform manylinux_2_17_x86_64 --python-version 3.12 \
            -d "$WORK/wheel" --index-url https://pypi.org/simple "nvidia-cuda-runtime==$CUDART" >&2
        wheel=$(find "$WORK/wheel" -name '*.whl' | head -1)
    fi
    [ -n "$wheel" ] || die "no nvidia-cuda-runtime $CUDART wheel"
    echo "$wheel"
}

build_root() {
    ubuntu_keyring
    log "debootstrap minbase noble from $MIRROR"
    debootstrap --variant=minbase --keyring="$KEYRING" \
        --include=ca-certificates,gnupg,ubuntu-keyring \
        noble "$ROOT" "$MIRROR" /usr/share/debootstrap/scripts/gutsy >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap of Ubuntu noble failed"; }
    # Ubuntu 24.04's image: deb822 sources and user `ubuntu` (uid 1000).
    : >"$ROOT/etc/apt/sources.list"
    cat >"$ROOT/etc/apt/sources.list.d/ubuntu.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: noble noble-updates noble-backports
Components: main restricted universe multiverse
Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg

Types: deb
URIs: http://security.ubuntu.com/ubuntu/
Suites: noble-security
Components: main restricted universe multiverse
Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg
EOF
    in_root useradd --create-home --uid 1000 --shell /bin/bash ubuntu

    log "CUDA runtime: libcudart from nvidia-cuda-runtime $CUDART"
    local wheel lib=$ROOT/usr/local/cuda-$CUDA_XY/targets/x86_64-linux/lib
    wheel=$(cudart_wheel)
    mkdir -p "$lib" "$WORK/whl" "$ROOT/usr/local/cuda-$CUDA_XY/bin"
    python3 -m zipfile -e "$wheel" "$WORK/whl"
    cp -a "$WORK/whl/nvidia/cu$CUDA_X/lib/libcudart.so.$CUDA_X" "$lib/libcudart.so.$CUDART"
    ln -s "libcudart.so.$CUDART" "$lib/libcudart.so.$CUDA_X"
    ln -s targets/x86_64-linux/lib "$ROOT/usr/local/cuda-$CUDA_XY/lib64"
    ln -s "cuda-$CUDA_XY" "$ROOT/usr/local/cuda-$CUDA_X"
    ln -s "cuda-$CUDA_XY" "$ROOT/usr/local/cuda"
    echo "/usr/local/cuda-$CUDA_XY/targets/x86_64-linux/lib" \
        >"$ROOT/etc/ld.so.conf.d/988_cuda-$CUDA_X.conf"
    printf '/usr/local/nvidia/lib\n/usr/local/nvidia/lib64\n' >"$ROOT/etc/ld.so.conf.d/nvidia.conf"
    in_root ldconfig
    in_root sh -c "ldconfig -p | grep -q 'libcudart.so.$CUDA_X '" \
        || die "ldconfig does not find libcudart.so.$CUDA_X"

    rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin \
        "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/log/* "$ROOT"/tmp/*
    : >"$ROOT/etc/resolv.conf"
    echo localhost >"$ROOT/etc/hostname"
}

KEY=$({ echo "$BASE $MIRROR $CUDART"; cat "$SCRIPT"; } | sha256sum | cut -c1-16)
TARBALL=$CACHE/rootfs-cuda-$KEY.tar
if [ -s "$TARBALL" ]; then
    log "cached root filesystem $TARBALL"
else
    build_root
    tar --numeric-owner --xattrs -C "$ROOT" -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
    for f in "$CACHE"/rootfs-cuda-*.tar; do [ "$f" = "$TARBALL" ] || rm -f "$f"; done
fi
log "docker import -> $BASE"
"$DOCKER" import \
    --change "ENV PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64" \
    --change "ENV NVARCH=x86_64 CUDA_VERSION=$CUDA_VERSION NV_CUDA_CUDART_VERSION=$CUDART" \
    --change "ENV NVIDIA_REQUIRE_CUDA=cuda>=$CUDA_XY NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility" \
    --change "ENV FORAGE_LOCAL_STAND_IN=1" \
    --change 'CMD ["/bin/bash"]' \
    --message "forage local stand-in for $BASE (deploy/local-gpu-base-image.sh)" \
    "$TARBALL" "$BASE" >/dev/null
log "$BASE ready in ${SECONDS}s"
