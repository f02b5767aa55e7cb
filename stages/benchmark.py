"""DVC entry point of the benchmark stage: `edgepath benchmark` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.benchmark import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
