"""A rank that waits seconds for rank 0 waits asleep, not spinning on a core that another
job's ranks need (a shared CPU node, this suite's parallel workers)."""
from conftest import REPO, TESTS, mpirun


def test_a_rank_waiting_for_rank_0_uses_no_core():
    # yield_when_idle 0: MPI's own wait spins, as on a node where ranks do not outnumber cores
    proc = mpirun(2, [f"{TESTS}/scripts/wait_idle.py", "2"], timeout=120,
                  env={"OMPI_MCA_mpi_yield_when_idle": "0", "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    cpu = dict(line.split() for line in proc.stdout.splitlines()
               if line.startswith(("barrier", "wait_idle")))
    assert float(cpu["wait_idle"]) < 0.2, cpu  # asleep: a few hundred wake-ups
    assert float(cpu["barrier"]) > 0.1, cpu  # the contrast: MPI's spin (up to a core for 2 s)
