"""Ends normally, with rank 0 finishing its own work after the others reached the end
(argv[1] seconds); with argv[2] == "exit" every rank ends with sys.exit(0)."""
import sys
import time

import mpilearn

mpilearn.init()
if mpilearn.rank() == 0:
    time.sleep(float(sys.argv[1]))
    print("rank 0 finished its late work", flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "exit":
    sys.exit(0)
