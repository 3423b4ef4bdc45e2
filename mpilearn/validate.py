"""``python -m mpilearn.validate``: kept as the short entry point; the code is in :mod:`mpilearn.calo.validate`."""
import sys

from .calo.validate import main

if __name__ == "__main__":
    sys.exit(main())
