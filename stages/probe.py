"""DVC entry point of the probe stage: `edgepath probe` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.probe import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
