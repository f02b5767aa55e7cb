"""DVC entry point of the manifest stage: `edgepath manifest build` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.manifest import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, ["build", *sys.argv[1:]]))
