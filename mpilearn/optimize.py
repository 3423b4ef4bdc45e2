"""``python -m mpilearn.optimize``: the short entry point of the sweep;
the code is in :mod:`mpilearn.hpo.optimize`."""
import sys

from .hpo.optimize import main

if __name__ == "__main__":
    sys.exit(main())
