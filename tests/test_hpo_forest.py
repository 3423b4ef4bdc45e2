"""The forest searcher (extra trees, a UCB weight drawn per suggestion, fits off the asks):
its two verbs, its option checks, its resume from the journal, and a quick 1 024-worker row
in which the model, not the fallback, keeps handing out the points."""
import json

import numpy as np
import pytest

from conftest import mpirun
from mpilearn.core.io import read_jsonl
from mpilearn.errors import UsageError
from mpilearn.hpo import benchmarks
from mpilearn.hpo.coordinator import Coordinator
from mpilearn.hpo.journal import Journal
from mpilearn.hpo.pruners import make_pruner
from mpilearn.hpo.searchers import make_searcher
from mpilearn.hpo.space import Space, trial_key

SPACE = Space.from_config(benchmarks.space("hartmann6"))


def told(searcher, n, seed=0):
    rng = np.random.default_rng(seed)
    points = [SPACE.sample(rng) for _ in range(n)]
    searcher.tell_many([(p, benchmarks.hartmann6(p)) for p in points])
    return points


def test_ask_and_tell():
    """n_initial random points first, nothing from a model before 2 results, then model
    points: distinct, none excluded, none busy, better than what it was told; a failed
    trial (None) teaches nothing."""
    forest = make_searcher("forest", SPACE, 0, n_initial=3)
    first = forest.ask_many(5)
    assert [o for _, o in first] == ["initial"] * 3  # no result yet: no model point
    forest.tell_many([(first[0][0], None)])
    assert forest.ask_many(2) == [] and forest.y == []
    points = told(forest, 40)
    busy = [SPACE.sample(np.random.default_rng(1)) for _ in range(50)]
    exclude = {trial_key(p) for p in points + busy}
    batch = forest.ask_many(64, busy, exclude)
    assert len(batch) == 64 and {o for _, o in batch} == {"model"}
    keys = [trial_key(p) for p, _ in batch]
    assert len(set(keys)) == 64 and not set(keys) & exclude
    assert forest.asked == 3 + 64  # every point handed out counts (the randomness key)
    assert np.median([benchmarks.hartmann6(p) for p, _ in batch]) < \
        np.median([benchmarks.hartmann6(p) for p in points])
    X = np.array([SPACE.encode(p) for p, _ in batch])
    gaps = np.linalg.norm(X[:, None] - X[None], axis=2) + np.eye(len(X))
    assert gaps.min() > 1e-4  # spread: each suggestion drew its own weight and trees


def test_fits_run_off_the_asks():
    """With results told meanwhile, an ask is answered from the newest finished forest at
    once; the refit runs in its own thread and catches up."""
    forest = make_searcher("forest", SPACE, 0, n_initial=1)
    forest.ask_many(1)
    told(forest, 200)
    forest.ask_many(8)  # the first model: fitted inline
    assert forest.fitted_n == 200 and forest.fits == 1
    told(forest, 3000, seed=1)
    got = forest.ask_many(8)  # a refit starts; this batch comes from the 200-result forest
    assert len(got) == 8 and {o for _, o in got} == {"model"}
    forest.wait_fitted()
    assert forest.fitted_n == 3200 and forest.fits == 2


@pytest.mark.parametrize("options, says", [
    ({"n_trees": 8}, "search.options.n_trees: not an option of the forest searcher "
                     "(did you mean 'trees'?)"),
    ({"trees": 1}, "trees must be at least 2"),
    ({"kappa": -1.0}, "kappa and niche must be >= 0"),
    ({"niche": -0.1}, "niche -0.1"),
    ({"local_scale": 2.0}, "local_scale in (0, 1]"),
    ({"n_initial": 0}, "n_initial must be at least 1"),
])
def test_bad_options_are_refused_with_one_clear_message(options, says):
    with pytest.raises(UsageError) as err:
        make_searcher("forest", SPACE, 0, **options)
    assert says in str(err.value)


def replayed(journal_path):
    """A forest rebuilt from a journal as the coordinator rebuilds it on --resume."""
    forest = make_searcher("forest", SPACE, 0, n_initial=64)
    state = Journal(journal_path).replay()
    # the coordinator's own replay, without its prefetch thread (which would ask at once)
    coordinator = object.__new__(Coordinator)
    coordinator.state, coordinator.obj = state, {"signs": [1.0], "directions": ["minimize"]}
    coordinator.pruner, coordinator.stopped = make_pruner("none"), {}
    coordinator._replay(forest, ())
    return forest, state


def simulate(out, evals, *extra):
    return mpirun(2, ["-m", "mpilearn.hpo.simulate", "--workers", "64", "--evals-per-worker",
                      str(evals), "--median-s", "0.3", "--searcher", "forest", "--options",
                      json.dumps({"n_initial": 64}), "--out", str(out), *extra], timeout=120)


def test_resume_from_the_journal(tmp_path):
    """A sweep of 128 trials, then --resume with a budget of 256: the forest relearns every
    result and its hand-out count from the journal (no second round of initial points), two
    rebuilds suggest the same batch, and every trial is done once."""
    out = tmp_path / "sim"
    proc = simulate(out, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = str(out / "journal.jsonl")
    a, state = replayed(path)
    b, _ = replayed(path)
    assert a.initial_handed == 64 and a.asked == 128 and len(a.y) == 128
    exclude = set(state.started)
    assert [trial_key(p) for p, _ in a.ask_many(16, (), exclude)] == \
        [trial_key(p) for p, _ in b.ask_many(16, (), exclude)]
    proc = simulate(out, 4, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_jsonl(path)
    started = sorted((e for e in events if e["event"] == "started"), key=lambda e: e["trial"])
    assert [e["trial"] for e in started] == list(range(256))
    assert sorted(e["key"] for e in events if e["event"] == "done") == \
        sorted(e["key"] for e in started)
    assert [e["origin"] for e in started].count("initial") == 64
    later = [e["origin"] for e in started[128:]]
    assert later.count("model") >= 0.9 * len(later), later


def test_1024_simulated_workers_stay_model_driven(tmp_path):
    """A quick row: 1 024 blocks against the real coordinator, 3 trials each (the first wave
    random). At least 90 % of the later points come from the forest, and the best point
    found beats the best of the random first wave."""
    out = tmp_path / "sim"
    proc = mpirun(2, ["-m", "mpilearn.hpo.simulate", "--workers", "1024", "--evals-per-worker",
                      "3", "--median-s", "3", "--searcher", "forest", "--options",
                      json.dumps({"n_initial": 1024}), "--out", str(out)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_jsonl(str(out / "journal.jsonl"))
    started = [e for e in events if e["event"] == "started"]
    origins = [e["origin"] for e in started]
    assert len(started) == 3072 and origins.count("initial") == 1024
    assert origins.count("model") >= 0.9 * 2048, {o: origins.count(o) for o in set(origins)}
    sim = json.load(open(out / "sim.json"))
    true = {t: v for t, _, v in sim["trials"]}
    first = min(true[e["trial"]] for e in started if e["origin"] == "initial")
    later = min(true[e["trial"]] for e in started if e["origin"] == "model")
    assert later < first, (later, first)
