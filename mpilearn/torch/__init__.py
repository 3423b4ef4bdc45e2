"""``import mpilearn.torch as hvd``: the public API of ``horovod.torch`` 0.28, over MPI.

    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

Beyond Horovod, every call takes an optional ``comm=`` (an mpi4py communicator), so the same
code runs inside an HPO block; the porting guide (docs/guide/horovod.md) lists the few differences.
"""
from .autograd import (allgather, allgather_async, allreduce, alltoall, alltoall_async,
                       grouped_allgather, grouped_allgather_async, grouped_allreduce,
                       grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                       grouped_reducescatter, grouped_reducescatter_async, reducescatter,
                       reducescatter_async, broadcast)
from .basics import (ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                     ddl_built, global_process_set, gloo_built, gloo_enabled, init,
                     is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rank,
                     remove_process_set, rocm_built, shutdown, size, start_timeline,
                     stop_timeline)
from .collectives import (allreduce_, allreduce_async, allreduce_async_, barrier, broadcast_,
                          broadcast_async, broadcast_async_, join, poll, synchronize)
from . import elastic
from .compression import Compression
from .elastic import HostsUpdatedInterrupt
from .engine import Adasum, Average, HorovodInternalError, Max, Min, Product, Sum
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters, sparse_allreduce_async)
from .optimizer import DistributedOptimizer, get_backend, set_default_backend
from .sync_batch_norm import SyncBatchNorm
