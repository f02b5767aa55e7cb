"""DVC entry point of the patch-verify stage: `edgepath patch-verify` (see its --help)."""

import sys

from edgepath.cli import main

if __name__ == "__main__":
    sys.exit(main(["patch-verify", *sys.argv[1:]]))
