"""The peer: plain PyTorch DistributedDataParallel with gloo, the way its docs recommend
(DistributedSampler + DataLoader + DDP(model)), on the same model file and HDF5 data as
mpilearn.train. Launched by mpirun (rank and size from Open MPI's environment).

    mpirun -np 2 python bench/ddp_peer.py MODEL.py DATA.h5 GLOBAL_BATCH STEPS OUT.json
"""
import json
import os
import sys
import time

import h5py
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class H5(Dataset):
    def __init__(self, path, keys):
        self.path, self.keys, self.f = path, keys, None
        with h5py.File(path) as f:
            self.n = len(f[keys[0]])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path)
        return tuple(torch.as_tensor(self.f[k][i]) for k in self.keys)


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
    ds = H5(data, task.inputs + [task.target])
    sampler = DistributedSampler(ds, num_replicas=size, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=int(global_batch) // size, sampler=sampler, drop_last=True,
                        num_workers=1, persistent_workers=True, prefetch_factor=4)
    steps = int(steps)
    done, data_wait, t_start = 0, 0.0, None
    for epoch in range(100):
        sampler.set_epoch(epoch)
        it = iter(loader)
        while done < 2 * steps:
            t0 = time.perf_counter()
            try:
                *xs, y = next(it)
            except StopIteration:
                break
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
