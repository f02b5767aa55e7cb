#!/usr/bin/env bash
# Set up (scripts/setup.sh, and scripts/setup_images.sh for the image build test) and
# run the whole test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup_images.sh
export PATH="$PWD/.venv/bin:$PATH" DVC_NO_ANALYTICS=1
exec python -m pytest "$@"
