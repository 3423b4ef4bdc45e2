"""``python -m mpilearn.simulate``: kept as the short entry point; the code is in :mod:`mpilearn.calo.simulate`."""
import sys

from .calo.simulate import main

if __name__ == "__main__":
    sys.exit(main())
