"""DVC entry point of the manifest stage: `edgepath manifest build` (see its --help)."""

import sys

from edgepath import command
from edgepath.manifest import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, ["build", *sys.argv[1:]]))
