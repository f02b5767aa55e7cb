"""DVC entry point of the probe stage: `edgepath probe` (see its --help)."""

import sys

from edgepath import command
from edgepath.probe import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
