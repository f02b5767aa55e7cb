"""DVC entry point of the patch-verify stage: `edgepath patch-verify` (see its --help)."""

import sys

from edgepath.core import command
from edgepath.stages.patch_verify import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
