"""``python -m encgraph``: the same command line as the ``encgraph`` script."""

import sys

from encgraph.cli import main

if __name__ == "__main__":
    sys.exit(main())
