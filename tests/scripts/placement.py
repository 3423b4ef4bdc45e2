"""One line per rank: where it runs and what mpilearn makes of it (node-local rank, the GPU
it would bind with two GPUs per node, its CPU threads), for the two-node tests."""
import json
import socket

from mpilearn.core import comm

ctx = comm.init()
line = {"rank": ctx.rank, "size": ctx.size, "host": socket.gethostname(),
        "local_rank": ctx.local_rank, "local_size": ctx.local_size,
        "device": comm.choose_device(ctx, "cuda", n_gpus=2), "threads": comm.threads_per_rank(ctx),
        "launch": comm.check_launch(ctx)}
lines = ctx.comm.gather(line, root=0)
if ctx.rank == 0:
    for item in lines:
        print("placement", json.dumps(item), flush=True)
