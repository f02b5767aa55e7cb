"""DVC entry point of the select stage: `edgepath select` (see its --help). Not named
select.py: a script's folder leads sys.path, and that name would shadow the stdlib module."""

import sys

from edgepath import command
from edgepath.select import COMMAND

if __name__ == "__main__":
    sys.exit(command.run(COMMAND, sys.argv[1:]))
