"""DVC entry point of the control stage: `edgepath control` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.control import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
