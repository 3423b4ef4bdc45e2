"""Rank 0 crashes (an uncaught exception: MPI_Abort) the first time, when ``sys.argv[1]`` does
not exist yet (it creates it); ``sys.argv[2]`` = "usage": every rank exits 2 instead;
"always": rank 0 crashes every time."""
import os
import sys

import mpilearn

mpilearn.init()
if sys.argv[2:] == ["usage"]:
    sys.exit(2)
if mpilearn.rank() == 0 and sys.argv[2:] == ["always"]:
    raise RuntimeError("crash on every run")
if mpilearn.rank() == 0 and not os.path.exists(sys.argv[1]):
    open(sys.argv[1], "w").close()
    raise RuntimeError("crash on the first run")
