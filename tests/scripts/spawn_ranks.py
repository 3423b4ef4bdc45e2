"""membership.spawn and membership.joined under a real mpirun: ``spawn_ranks.py HOSTS`` run by
every rank spawns one more (this script again) with HOSTS added to the launcher's allocation,
merges it after them and prints one JSON line from each process; where the launcher refuses
(no free slot), each rank prints the refusal instead (what the driver's fallback sees)."""
import json
import sys

from mpi4py import MPI

from mpilearn.core import membership

merged = membership.joined()
if merged is None:
    try:
        merged = membership.spawn(MPI.COMM_WORLD, 1, [sys.executable, __file__], sys.argv[1])
    except MPI.Exception as err:
        print(json.dumps({"refused": err.Get_error_string()}), flush=True)
        sys.exit(0)
ranks = merged.allgather(membership.spawned())
print(json.dumps({"rank": merged.Get_rank(), "size": merged.Get_size(), "spawned": ranks}),
      flush=True)
merged.Barrier()
