"""``python -m mpilearn.generate``: the short entry point; the code is in :mod:`mpilearn.calo.generate`."""
import sys

from .calo.generate import main

if __name__ == "__main__":
    sys.exit(main())
