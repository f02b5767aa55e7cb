"""DVC entry point of the control stage: `edgepath control` (see its --help)."""

import sys

from edgepath.cli import main

if __name__ == "__main__":
    sys.exit(main(["control", *sys.argv[1:]]))
