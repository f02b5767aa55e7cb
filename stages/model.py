"""DVC entry point of the model stage: `edgepath model` (see its --help)."""

import sys

from edgepath import command
from edgepath.model import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
