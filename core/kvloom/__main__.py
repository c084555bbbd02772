"""``python -m kvloom``: the ``kvloom`` command, run by this interpreter."""

import sys

from kvloom.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
