"""DVC entry point of the bundle stage: `edgepath bundle` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.bundle import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
