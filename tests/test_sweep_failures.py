"""Failures at scale, by simulation: blocks that vanish mid-trial and blocks that hang until
the watchdog resets them cost their trial's lost part, never a trial: each is journalled as
interrupted, runs again on another block, and the sweep ends with exactly its budget."""
import json

from conftest import mpirun
from mpilearn.core.io import read_jsonl

WORKERS, EVALS = 32, 4


def test_vanishing_and_hanging_blocks_lose_no_trial(tmp_path):
    out = tmp_path / "sim"
    proc = mpirun(2, ["-m", "mpilearn.hpo.simulate", "--workers", str(WORKERS),
                      "--evals-per-worker", str(EVALS), "--median-s", "0.2", "--searcher",
                      "random", "--fail-fraction", "0.25", "--out", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_jsonl(str(out / "journal.jsonl"))
    sim = json.load(open(out / "sim.json"))
    # 8 blocks fail, 4 of each kind, each in one of its first 2 trials (a block that got
    # fewer, one very long trial, does not fail)
    kinds = [kind for _, kind, _ in sim["lost"]]
    assert len(kinds) >= 6 and kinds.count("hang") <= 4 and kinds.count("vanish") <= 4
    assert "hang" in kinds and "vanish" in kinds
    interrupted = [e for e in events if e["event"] == "interrupted"]
    assert sorted(e["block"] for e in interrupted) == sorted(b for b, _, _ in sim["lost"])
    assert {e["reason"].split(":")[0] for e in interrupted} == {
        "stuck", "rank 0 of the block lost (simulated)"}
    done = [e["key"] for e in events if e["event"] == "done"]
    assert len(done) == WORKERS * EVALS and len(set(done)) == len(done)  # the budget, once each
    started = [e for e in events if e["event"] == "started"]
    assert len({e["key"] for e in started}) == WORKERS * EVALS
    for key in {e["key"] for e in interrupted}:  # each loss of a trial: one more run of it
        again = [e for e in started if e["key"] == key and e.get("requeued")]
        assert len(again) == sum(e["key"] == key for e in interrupted), key
    vanished = {b for b, kind, _ in sim["lost"] if kind == "vanish"}
    for block in vanished:  # a vanished block is given nothing after its loss
        gone = max(i for i, e in enumerate(events)
                   if e["event"] == "interrupted" and e["block"] == block)
        assert not [e for e in events[gone:] if e["event"] == "started" and e["block"] == block]
    # where the idle capacity went: the parts and the trials' time add up to the windows, the
    # hangs are the watchdog's time each (--hang-s: the median, 0.2 s), the lost work is some
    parts = sim["idle_parts_s"]
    assert abs(sum(sim["busy_s"]) + sum(parts.values()) - sum(sim["window_s"])) < 1e-6
    assert abs(parts["hang_s"] - 0.2 * kinds.count("hang")) < 1e-6
    assert 0 < parts["lost_work_s"] and 0 < parts["trial_wait_s"]
