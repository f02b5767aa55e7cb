"""DVC entry point of the quantize stage: `edgepath quantize` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.quantize import COMMAND

if __name__ == "__main__":  # vLLM (the engine check) needs the guard: it forces spawn
    sys.exit(command.run(COMMAND, sys.argv[1:]))
