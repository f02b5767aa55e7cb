"""DVC entry point of the select stage: `edgepath select` (see its --help). Not named
select.py: a script's folder leads sys.path, and that name would shadow the stdlib module."""

import sys

from edgepath.core import command
from edgepath.stages.select import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
