"""DVC entry point of the export stage: `edgepath export` (see its --help)."""

import sys

from edgepath.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
