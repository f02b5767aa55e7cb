"""DVC entry point of the bundle stage: `edgepath bundle` (see its --help)."""

import sys

from edgepath.cli import main

if __name__ == "__main__":
    sys.exit(main(["bundle", *sys.argv[1:]]))
