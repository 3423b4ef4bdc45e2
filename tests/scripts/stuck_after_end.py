"""Rank 0 records the job's end (as an elastic run's does, ``comm.record_end``); then rank 1
dies of SIGSEGV and rank 0 stays where it is: the grown job that waited for good in
MPI_Finalize after a rank crashed there (Open MPI 5.0 with --with-ft ulfm)."""
import os
import signal
import time

from mpilearn.core import comm

ctx = comm.init()
ctx.comm.Barrier()
if ctx.rank == 0:
    comm.record_end(0)
    time.sleep(3600)  # stands for MPI_Finalize waiting for a peer that is gone
else:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSEGV)
