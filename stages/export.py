"""DVC entry point of the export stage: `edgepath export` (see its --help)."""

import sys

from edgepath import command
from edgepath.export import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
