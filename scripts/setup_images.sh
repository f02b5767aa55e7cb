#!/usr/bin/env bash
# Install what images/build needs on a Debian host: buildah and podman (daemonless
# builds and runs; no Docker engine), runc, debootstrap (the local base), and QEMU's
# user-mode aarch64 emulator with binfmt_misc (the arm64 image on an x86 host).
# Needs root; elsewhere it says so and does nothing (the image tests then skip).
# Idempotent.
set -euo pipefail

packages=(buildah podman runc debootstrap qemu-user-static binfmt-support)
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "setup_images: not root on a Debian host; install ${packages[*]} to build the images" >&2
    exit 0
fi
if ! dpkg-query -W "${packages[@]}" >/dev/null 2>&1; then
    apt-get -qq update
    DEBIAN_FRONTEND=noninteractive apt-get -qq install -y "${packages[@]}" >/dev/null
fi
# arm64 under emulation: binfmt_misc mounted and qemu-aarch64 registered (F flag: the
# interpreter is opened at registration, so it works inside a container's root).
if [[ ! -e /proc/sys/fs/binfmt_misc/register ]]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc || echo "setup_images: cannot mount binfmt_misc; no arm64 builds" >&2
fi
if [[ -e /proc/sys/fs/binfmt_misc/register && ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]]; then
    update-binfmts --enable qemu-aarch64 || echo "setup_images: cannot register qemu-aarch64; no arm64 builds" >&2
fi
