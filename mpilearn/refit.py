"""``python -m mpilearn.refit``: the short entry point of the best trial's final model;
the code is in :mod:`mpilearn.hpo.refit`."""
import sys

from .hpo.refit import main

if __name__ == "__main__":
    sys.exit(main())
