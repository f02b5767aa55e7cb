"""DVC entry point of the benchmark stage: `edgepath benchmark` (see its --help)."""

import sys

from edgepath.cli import main

if __name__ == "__main__":
    sys.exit(main(["benchmark", *sys.argv[1:]]))
