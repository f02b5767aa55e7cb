"""DVC entry point of the model stage: `edgepath model` (see its --help)."""

import sys

from edgepath.cli import main

if __name__ == "__main__":
    sys.exit(main(["model", *sys.argv[1:]]))
