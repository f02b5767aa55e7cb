"""DVC entry point of the control stage: `edgepath control` (see its --help)."""

import sys

from edgepath import command
from edgepath.control import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
