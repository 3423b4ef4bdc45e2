"""Shared by the bench scripts: where results go and how they are written."""
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write(out: str, data, markdown: list) -> None:
    """OUT.json (raw numbers) and OUT.md (the table), and the table on stdout."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write("\n".join(markdown) + "\n")
    print("\n".join(markdown))


def median_seconds(fn, comm, repeats: int, warmup: int = 0, after=None) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, all ranks starting together;
    ``after()``, untimed, follows each call (what must run before the next one)."""
    import time

    import numpy as np

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return float(np.median(times))
