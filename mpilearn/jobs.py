"""``python -m mpilearn.jobs``: the short entry point of batch-job rendering;
the code is in :mod:`mpilearn.cluster.jobs`."""
import sys

from .cluster.jobs import main

if __name__ == "__main__":
    sys.exit(main())
