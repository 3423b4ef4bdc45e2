"""mpirun -np 2 python wait_idle.py SECONDS: rank 0 works SECONDS alone (as in the plan's
checks) while rank 1 waits, once in a plain Barrier and once in mpilearn's wait_idle; rank 1
prints the CPU seconds each wait took."""
import sys
import time

from mpi4py import MPI

from mpilearn.core.comm import wait_idle

comm, seconds = MPI.COMM_WORLD, float(sys.argv[1])
for name, wait in (("barrier", comm.Barrier), ("wait_idle", lambda: wait_idle(comm))):
    start = time.process_time()
    if comm.rank == 0:
        time.sleep(seconds)
    wait()
    if comm.rank == 1:
        print(f"{name} {time.process_time() - start:.3f}", flush=True)
