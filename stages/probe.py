"""DVC entry point of the probe stage: `edgepath probe` (see its --help)."""

import sys

from edgepath.cli import main

if __name__ == "__main__":
    sys.exit(main(["probe", *sys.argv[1:]]))
