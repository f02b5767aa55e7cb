"""DVC entry point of the manifest stage: `edgepath manifest build` (see its --help)."""

import sys

from edgepath.cli import main

if __name__ == "__main__":
    sys.exit(main(["manifest", "build", *sys.argv[1:]]))
