"""DVC entry point of the calibrate stage: `edgepath calibrate` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.calibrate import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
