"""Every rank raises: each one's abort hook calls MPI_Abort (``sys.argv[1]``: "all" or a rank)."""
import sys

import mpilearn

mpilearn.init()
if sys.argv[1] == "all" or mpilearn.rank() == int(sys.argv[1]):
    raise ValueError("boom")
import time  # noqa: E402

time.sleep(30)
