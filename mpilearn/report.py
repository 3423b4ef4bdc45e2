"""``python -m mpilearn.report``: the short entry point of a sweep's report;
the code is in :mod:`mpilearn.hpo.report`."""
import sys

from .hpo.report import main

if __name__ == "__main__":
    sys.exit(main())
