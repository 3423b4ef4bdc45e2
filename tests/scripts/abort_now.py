"""Every rank calls MPI_Abort(3) at once, through mpilearn's abort path (which records it):
under ``mpirun --with-ft ulfm`` Open MPI 5.0 was seen to never end such a job."""
import mpilearn
from mpilearn.core.comm import abort, mpi

mpilearn.init()
abort(mpi().COMM_WORLD, 3)
