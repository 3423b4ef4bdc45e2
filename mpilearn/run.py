"""``python -m mpilearn.run``: the horovodrun-style launcher (also ``mpilearn-run``); the code
is in :mod:`mpilearn.cluster.run`."""
import sys

from .cluster.run import main

if __name__ == "__main__":
    sys.exit(main())
