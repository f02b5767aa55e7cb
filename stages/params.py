"""DVC entry point of the params stage: `edgepath params` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.params import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
