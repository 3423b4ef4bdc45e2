"""The peer: plain PyTorch DistributedDataParallel with gloo (DDP(model), the optimizer
stepped after backward), on the same model file and HDF5 data as mpilearn.train, fed by
mpilearn's own loader (event-level shards, the same shuffle, a prefetch thread), so that
the row compares communication and wrapping only, not data loading. Launched by mpirun
(rank and size from Open MPI's environment).

    mpirun -np 2 python bench/ddp_peer.py MODEL.py DATA.h5 GLOBAL_BATCH STEPS OUT.json
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from mpilearn.data.hdf5 import EventFiles, ShardedLoader


def main():
    model_file, data, global_batch, steps, out = sys.argv[1:6]
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(max(1, os.cpu_count() // size))
    sys.path.insert(0, os.path.dirname(os.path.abspath(model_file)))
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_model", model_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    task = mod.build({})
    model = torch.nn.parallel.DistributedDataParallel(task.model)
    opt = task.optimizer
    files = EventFiles([data], task.inputs + [task.target])
    loader = ShardedLoader(files, np.arange(len(files)), int(global_batch) // size, rank, size,
                           seed=0, transform=task.transform)
    steps = int(steps)
    done, data_wait, t_start = 0, 0.0, None
    for epoch in range(100):
        it = loader.batches(epoch)
        while done < 2 * steps:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            xs = [torch.as_tensor(batch[k]) for k in task.inputs]
            y = torch.as_tensor(batch[task.target])
            if done == steps:  # the first half warms up, the second is measured
                t_start, data_wait = t0, 0.0
            data_wait += time.perf_counter() - t0
            opt.zero_grad()
            loss = task.loss(model(*xs), y)
            loss.backward()
            opt.step()
            done += 1
        if done >= 2 * steps:
            break
    wall = time.perf_counter() - t_start
    if rank == 0:
        json.dump({"samples_per_s": steps * int(global_batch) / wall,
                   "per_step_ms": {"seconds": 1000 * wall / steps, "data": 1000 * data_wait / steps}},
                  open(out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
