#!/usr/bin/env bash
# Local stand-ins for the third-party base images that deploy/Dockerfile's cpu target and
# docker-compose.yml's redis service use, built from Debian packages, for air-gapped machines:
# machines that reach Debian's package mirror (or have run this once) but no container
# registry, so `docker pull` / `FROM python:...` cannot fetch anything. Each image gets the SAME
# name and tag as the one it stands in for, so deploy/Dockerfile and docker-compose.yml are used
# unchanged:
#
#   python:3.11.9-slim-bookworm (the name in deploy/Dockerfile's `FROM ... AS cpu`)
#       debootstrap --variant=minbase bookworm + Debian's python3.11 (3.11.2, not 3.11.9) as a
#       virtualenv rooted at /usr/local (/usr/local/bin/python, python3, pip, pip3: pip installs
#       into /usr/local as in the official image, without Debian's externally-managed guard),
#       its headers (python3.11-dev: the official image has Python.h, which DeepSpeed's
#       just-in-time op builds need), ca-certificates, netbase, tzdata, LANG=C.UTF-8, CMD python3.
#       The apt packages the cpu stage installs (parsed from its `apt-get install` lines, today
#       build-essential) are preinstalled and the image's apt sources are left empty: the
#       stage's `apt-get update && apt-get install ...` then succeeds offline (nothing to
#       fetch; the packages are already installed).
#   redis:7.2.5-alpine (the name of the redis service's image in docker-compose.yml)
#       minbase + Debian's redis-tools (Redis 7.0.15, not 7.2.5): redis-server and redis-cli on
#       PATH (/usr/local/bin/redis-server, /usr/bin/redis-cli), ENTRYPOINT docker-entrypoint.sh
#       as in the official image (chowns /data, drops to user redis, protected mode off),
#       CMD redis-server, WORKDIR and VOLUME /data, port 6379. The healthcheck `redis-cli ping`
#       and the compose command `redis-server --save "" --appendonly yes ...` work as written.
#
#   prom/prometheus:v2.53.0 (the prometheus service's image)
#       minbase + Debian's prometheus (2.42.0): /bin/prometheus as ENTRYPOINT with the official
#       image's CMD (--config.file=/etc/prometheus/prometheus.yml --storage.tsdb.path=/prometheus),
#       USER nobody, WORKDIR and VOLUME /prometheus, port 9090.
#   oliver006/redis_exporter:v1.62.0 (the redis-exporter service's image)
#       minbase + Debian's prometheus-redis-exporter (1.45.0) as /redis_exporter, the ENTRYPOINT,
#       USER 59000:59000, port 9121; it reads REDIS_ADDR as the official one does.
#
# Each stand-in carries ENV FORAGE_LOCAL_STAND_IN=1 (docker image inspect tells it from the real
# one). Not built here: nvidia/cuda (the gpu target).
#
# Idempotent: an image that exists (stand-in or real) is skipped. Caches, in $FORAGE_IMAGE_CACHE
# (default /var/cache/forage-base-images):
#   debootstrap-NAME-KEY.tgz   the .debs (debootstrap --make-tarball): later runs need no mirror
#   rootfs-NAME-KEY.tar        the finished root filesystem: later runs only `docker import` it
# KEY hashes the recipe (suite, packages, mirror; for rootfs- also this script), so a change
# rebuilds; older versions of a cache file are removed.
#
# Time on a 2-core machine: cold (download + debootstrap) ~90 s for python, ~50 s for each of
# the others; from the rootfs cache a few seconds each (docker import).
#
# Usage (root; `apt-get install docker.io debootstrap`; DOCKER_HOST names the engine, e.g. the
# private one of tests/deploy/dockerd.py):
#   deploy/local-base-images.sh              # all four images
#   deploy/local-base-images.sh python redis # or some: python, redis, prometheus, exporter
# Environment: FORAGE_IMAGE_CACHE, DEBIAN_MIRROR (default http://deb.debian.org/debian), DOCKER
# (the docker CLI to use).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SCRIPT="$REPO/deploy/local-base-images.sh"
CACHE=${FORAGE_IMAGE_CACHE:-/var/cache/forage-base-images}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
DOCKER=${DOCKER:-docker}

log() { printf '[local-base-images %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (debootstrap and chroot need it)"
command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
command -v "$DOCKER" >/dev/null || die "docker CLI not found"
"$DOCKER" version >/dev/null || die "no docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unset})"
mkdir -p "$CACHE"

# ---------------------------------------------------------------- names from the deploy files
PYTHON_IMAGE=$(awk 'toupper($1) == "FROM" && toupper($3) == "AS" && $4 == "cpu" {print $2}' \
    "$REPO/deploy/Dockerfile")
compose_image() {  # compose_image SERVICE: the image of SERVICE in docker-compose.yml
    local image
    image=$(awk -v svc="  $1:" '$0 == svc {s=1; next} s && /^  [^ ]/ {s=0}
        s && $1 == "image:" {print $2; exit}' "$REPO/docker-compose.yml")
    [ -n "$image" ] || die "no image for the $1 service in docker-compose.yml"
    echo "$image"
}
REDIS_IMAGE=$(compose_image redis)
PROMETHEUS_IMAGE=$(compose_image prometheus)
EXPORTER_IMAGE=$(compose_image redis-exporter)
[ -n "$PYTHON_IMAGE" ] || die "no 'FROM ... AS cpu' in deploy/Dockerfile"
# The apt packages of the cpu stage: its `apt-get install` arguments that are not options.
CPU_APT=$(sed -n '/^FROM .* AS cpu/,/^FROM /p' "$REPO/deploy/Dockerfile" \
    | sed -e ':a' -e '/\\$/N; s/\\\n//; ta' | grep -o 'apt-get install[^&;|]*' \
    | tr -s ' \t' '\n' | grep -v -E '^(apt-get|install|-.*|)$' | sort -u | tr '\n' ' ' || true)

# ---------------------------------------------------------------- helpers
have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

debs_key() {  # debs_key INCLUDE: the hash of what debootstrap downloads
    echo "$SUITE minbase $MIRROR $1" | sha256sum | cut -c1-16
}
root_key() {  # root_key INCLUDE: the hash of the recipe (the packages and this script)
    { echo "$SUITE minbase $MIRROR $1"; cat "$SCRIPT"; } | sha256sum | cut -c1-16
}
keep_only() {  # keep_only FILE: remove the other cached versions of FILE (other keys)
    local f
    for f in "${1%-*}"-*; do [ "$f" = "$1" ] || rm -f "$f"; done
}

WORK=""
cleanup() {
    [ -n "$WORK" ] || return 0
    for m in proc sys dev; do mountpoint -q "$WORK/root/$m" 2>/dev/null && umount -l "$WORK/root/$m"; done
    rm -rf "$WORK"
}
trap cleanup EXIT

debootstrap_root() {  # debootstrap_root NAME INCLUDE ROOT: a minbase bookworm with INCLUDE
    local name=$1 include=$2 root=$3 key debs
    key=$(debs_key "$include")
    debs="$CACHE/debootstrap-$name-$key.tgz"
    if [ ! -s "$debs" ]; then
        log "$name: downloading .debs into $debs"
        mkdir -p "$WORK/mk"
        debootstrap --variant=minbase --include="$include" --make-tarball="$debs.tmp" \
            "$SUITE" "$WORK/mk" "$MIRROR" >"$WORK/debootstrap-download.log" 2>&1 \
            || { tail -20 "$WORK/debootstrap-download.log" >&2; die "debootstrap --make-tarball failed"; }
        mv "$debs.tmp" "$debs"
        keep_only "$debs"
        rm -rf "$WORK/mk"
    fi
    log "$name: debootstrap from $debs"
    debootstrap --variant=minbase --include="$include" --unpack-tarball="$debs" \
        "$SUITE" "$root" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -5 "$WORK/debootstrap.log" >&2
             grep -h -E '^dpkg|depends on|not installed' "$root/debootstrap/debootstrap.log" \
                 2>/dev/null | tail -20 >&2
             die "debootstrap failed (a virtual package in INCLUDE needs its real name)"; }
}

save_root() {  # save_root ROOT TARBALL: finish ROOT, keep it as TARBALL (the cache), remove it
    local root=$1 tarball=$2
    finish_root "$root"
    tar --numeric-owner --xattrs -C "$root" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    keep_only "$tarball"
    rm -rf "$root"
}

finish_root() {  # finish_root ROOT: offline apt, no caches, no host files
    local root=$1
    : >"$root/etc/apt/sources.list"
    rm -rf "$root"/etc/apt/sources.list.d/* "$root"/var/lib/apt/lists/* \
        "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
        "$root"/var/log/* "$root"/tmp/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
        "$root"/usr/share/info/*
    find "$root" -xdev -name __pycache__ -type d -prune -exec rm -rf {} +
    : >"$root/etc/resolv.conf"
    echo localhost >"$root/etc/hostname"
}

in_root() {  # in_root ROOT CMD...: run in a chroot with /proc, /sys and /dev
    local root=$1; shift
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys"
    mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev"
    local rc=0
    chroot "$root" /usr/bin/env -i PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        LANG=C.UTF-8 HOME=/root "$@" || rc=$?
    umount -l "$root/dev" "$root/sys" "$root/proc"
    return $rc
}

import_root() {  # import_root NAME IMAGE TARBALL CHANGES...
    local name=$1 image=$2 tarball=$3; shift 3
    local args=()
    for c in "$@"; do args+=(--change "$c"); done
    log "$name: docker import -> $image"
    "$DOCKER" import "${args[@]}" \
        --message "forage local stand-in for $image (deploy/local-base-images.sh)" \
        "$tarball" "$image" >/dev/null
}

# ---------------------------------------------------------------- python
build_python() {
    local include key tarball root
    # shellcheck disable=SC2086
    # python3-distutils: python3.11-venv needs python3.11-distutils, a virtual package that
    # debootstrap's resolver does not follow.
    include=$(echo python3.11 python3.11-venv python3.11-dev python3-distutils ca-certificates \
        netbase tzdata \
        $CPU_APT \
        | tr ' ' '\n' | sort -u | paste -sd, -)
    key=$(root_key "$include")
    tarball="$CACHE/rootfs-python-$key.tar"
    if [ ! -s "$tarball" ]; then
        root="$WORK/root"
        debootstrap_root python "$include" "$root"
        # A virtualenv at /usr/local: python, python3, pip, pip3 in /usr/local/bin, packages in
        # /usr/local/lib/python3.11/site-packages (pip and setuptools from Debian's wheels).
        in_root "$root" python3.11 -m venv /usr/local
        in_root "$root" /usr/local/bin/python -c 'import sys, pip; assert sys.prefix == "/usr/local"'
        save_root "$root" "$tarball"
    else
        log "python: cached root filesystem $tarball"
    fi
    import_root python "$PYTHON_IMAGE" "$tarball" \
        'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
        'ENV LANG=C.UTF-8' 'ENV PYTHON_VERSION=3.11' 'ENV FORAGE_LOCAL_STAND_IN=1' \
        'CMD ["python3"]'
}

# ---------------------------------------------------------------- redis
build_redis() {
    local include=redis-tools key tarball root
    key=$(root_key "$include")
    tarball="$CACHE/rootfs-redis-$key.tar"
    if [ ! -s "$tarball" ]; then
        root="$WORK/root"
        debootstrap_root redis "$include" "$root"
        # Debian ships one binary: redis-server is redis-check-rdb under another name.
        ln -sf /usr/bin/redis-check-rdb "$root/usr/local/bin/redis-server"
        # (redis-tools' postinst may have made user redis already)
        in_root "$root" sh -c 'getent group redis >/dev/null || groupadd --system redis
            getent passwd redis >/dev/null \
                || useradd --system --gid redis --home-dir /data --shell /usr/sbin/nologin redis'
        mkdir -p "$root/data"
        chroot "$root" chown redis:redis /data
        cat >"$root/usr/local/bin/docker-entrypoint.sh" <<'EOF'
#!/bin/sh
# As the official redis image's entrypoint: options alone run redis-server; as root, /data is
# handed to user redis and the server runs as redis. The official build compiles protected mode
# off (no password, reachable from other containers); Debian's is on, so it is turned off here
# (a later --protected-mode yes in the command still wins).
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then set -- redis-server "$@"; fi
if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then
    find . \! -user redis -exec chown redis '{}' +
    exec setpriv --reuid=redis --regid=redis --init-groups "$0" "$@"
fi
if [ "$1" = redis-server ]; then shift; exec redis-server --protected-mode no "$@"; fi
exec "$@"
EOF
        chmod 755 "$root/usr/local/bin/docker-entrypoint.sh"
        save_root "$root" "$tarball"
    else
        log "redis: cached root filesystem $tarball"
    fi
    import_root redis "$REDIS_IMAGE" "$tarball" \
        'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        'ENV FORAGE_LOCAL_STAND_IN=1' 'WORKDIR /data' 'VOLUME /data' 'EXPOSE 6379' \
        'ENTRYPOINT ["docker-entrypoint.sh"]' 'CMD ["redis-server"]'
}

# ---------------------------------------------------------------- prometheus, exporter
build_go_service() {  # build_go_service NAME PACKAGE PREPARE-FUNCTION: minbase + one Go binary
    local name=$1 package=$2 prepare=$3 key tarball root
    key=$(root_key "$package")
    tarball="$CACHE/rootfs-$name-$key.tar"
    if [ ! -s "$tarball" ]; then
        root="$WORK/root"
        debootstrap_root "$name" "$package" "$root"
        "$prepare" "$root"
        save_root "$root" "$tarball"
    else
        log "$name: cached root filesystem $tarball"
    fi
    echo "$tarball"
}

prepare_prometheus() {  # as the official image: /bin/prometheus, /prometheus owned by nobody
    local root=$1
    [ -x "$root/usr/bin/prometheus" ] || die "prometheus: no /usr/bin/prometheus in the package"
    mkdir -p "$root/prometheus" "$root/etc/prometheus"
    chroot "$root" chown nobody:nogroup /prometheus
}

prepare_exporter() {
    local root=$1
    ln -sf /usr/bin/prometheus-redis-exporter "$root/redis_exporter"
    [ -x "$root/usr/bin/prometheus-redis-exporter" ] || die "exporter: no binary in the package"
}

build_prometheus() {
    local tarball
    tarball=$(build_go_service prometheus prometheus prepare_prometheus)
    import_root prometheus "$PROMETHEUS_IMAGE" "$tarball" \
        'ENV FORAGE_LOCAL_STAND_IN=1' 'USER nobody' 'WORKDIR /prometheus' 'VOLUME /prometheus' \
        'EXPOSE 9090' 'ENTRYPOINT ["/bin/prometheus"]' \
        'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
}

build_exporter() {
    local tarball
    tarball=$(build_go_service exporter prometheus-redis-exporter prepare_exporter)
    import_root exporter "$EXPORTER_IMAGE" "$tarball" \
        'ENV FORAGE_LOCAL_STAND_IN=1' 'USER 59000:59000' 'EXPOSE 9121' \
        'ENTRYPOINT ["/redis_exporter"]'
}

# ---------------------------------------------------------------- main
WHICH=${*:-python redis prometheus exporter}
for what in $WHICH; do
    case $what in
        python) image=$PYTHON_IMAGE ;;
        redis) image=$REDIS_IMAGE ;;
        prometheus) image=$PROMETHEUS_IMAGE ;;
        exporter) image=$EXPORTER_IMAGE ;;
        *) die "unknown image '$what' (python, redis, prometheus, exporter)" ;;
    esac
    if have_image "$image"; then
        log "$what: $image exists, skipped"
        continue
    fi
    WORK=$(mktemp -d /tmp/forage-base-images.XXXXXX)
    SECONDS=0
    "build_$what"
    log "$what: $image ready in ${SECONDS}s"
    cleanup
    WORK=""
done
