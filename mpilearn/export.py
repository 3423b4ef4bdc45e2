"""``python -m mpilearn.export``: the short entry point; the code is in :mod:`mpilearn.calo.export`."""
import sys

from .calo.export import main

if __name__ == "__main__":
    sys.exit(main())
