#!/usr/bin/env bash
# Fetch the offline text corpora edgepath calibrates and evaluates on into DEST
# (default .venv/share/edgepath/corpora in the project root, where
# edgepath.corpus looks): Jane Austen's six novels, from Debian's package
# r-cran-janeaustenr, read there without R.
# Usage: scripts/fetch_corpora.sh [DEST]
# Idempotent: a corpus already in place is left alone and nothing is downloaded.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.venv/share/edgepath/corpora}
package=r-cran-janeaustenr
version=1.0.0-1
# Pinned so a changed or tampered archive is refused, not silently read.
deb_sha256=df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95

target=$dest/janeaustenr
if [[ -f $target/data/Rdata.rdb ]]; then
    exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "fetch_corpora: needs apt-get and dpkg-deb (a Debian-based system) to fetch $package" >&2
    exit 1
fi

download=$(mktemp -d)
mkdir -p "$dest"
# Extracted beside the destination (same filesystem) so the final mv is one rename.
stage=$(mktemp -d "$dest/.janeaustenr.XXXXXX")
trap 'rm -rf "$download" "$stage"' EXIT

apt=(apt-get)
# As root, apt hands the download to its unprivileged _apt user, which cannot write
# into a private mktemp directory, and warns; downloading as root is what it falls back to.
if [[ $(id -u) == 0 ]]; then
    apt+=(-o APT::Sandbox::User=root)
fi
if ! (cd "$download" && "${apt[@]}" -q download "$package=$version" >/dev/null); then
    echo "fetch_corpora: 'apt-get download $package=$version' failed; it needs a Debian archive" \
        "with that version (bookworm has it) in the apt sources; try 'apt-get update'" >&2
    exit 1
fi
deb=$download/${package}_${version}_all.deb
got=$(sha256sum "$deb" | cut -d' ' -f1)
if [[ $got != "$deb_sha256" ]]; then
    echo "fetch_corpora: $(basename "$deb") has sha256 $got, not the pinned $deb_sha256;" \
        "refusing it" >&2
    exit 1
fi

dpkg-deb -x "$deb" "$stage"
# Only a partial copy can be here (a complete one has Rdata.rdb and exited above);
# mv would nest the new one inside it.
rm -rf "$target"
mv -T "$stage/usr/lib/R/site-library/janeaustenr" "$target"
echo "fetch_corpora: installed $package $version in $target"
