"""DVC entry point of the quantize stage: `edgepath quantize` (see its --help)."""

import sys

from edgepath.cli import main

if __name__ == "__main__":  # vLLM (the engine check) needs the guard: it forces spawn
    sys.exit(main(["quantize", *sys.argv[1:]]))
