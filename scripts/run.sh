#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the pipeline on the default model and fleet, show the manifest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" DVC_NO_ANALYTICS=1
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    echo "run: DVC needs a git work tree; clone the repository (or run 'git init') first" >&2
    exit 1
fi
dvc repro "$@"
dvc push -q   # every output into the default remote (remote/), where `edgepath pull` reads it
edgepath manifest show manifest.json
