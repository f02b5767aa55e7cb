"""DVC entry point of the export stage: `edgepath export` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.export import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
