"""DVC entry point of the model stage: `edgepath model` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.model import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
