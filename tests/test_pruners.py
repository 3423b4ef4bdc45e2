"""Pruners against Optuna's own: the same reported values, in the same order, with trials
running side by side, must give the same verdicts."""
import numpy as np
import optuna
import pytest

from mpilearn.core.comm import UsageError
from mpilearn.hpo.pruners import SuccessiveHalvingPruner, make_pruner

optuna.logging.set_verbosity(optuna.logging.WARNING)


def schedule(seed, n_trials=40, steps=12, parallel=4):
    """Scripted learning curves reported by ``parallel`` trials at once, interleaved: a list of
    (trial, step, value) and the step after which each trial ends (if not stopped)."""
    rng = np.random.default_rng(seed)
    curves = {t: rng.uniform(0.2, 1.0) + rng.uniform(0.5, 2.0) / np.arange(1, steps + 1)
              + rng.normal(0, 0.05, steps) for t in range(n_trials)}
    if seed % 2:  # some NaNs: the rules have their own branch for them
        curves[3][2] = np.nan
    return curves, steps, parallel


def run_both(name, options, direction, seed):
    curves, steps, parallel = schedule(seed)
    optuna_pruner = {"median": optuna.pruners.MedianPruner,
                     "asha": optuna.pruners.SuccessiveHalvingPruner,
                     "hyperband": optuna.pruners.HyperbandPruner}[name](**options)
    study = optuna.create_study(study_name="mpilearn", direction=direction, pruner=optuna_pruner,
                                sampler=optuna.samplers.RandomSampler(seed=0))
    ours = make_pruner(name, direction, **options)
    sign = -1 if direction == "maximize" else 1
    waiting = list(range(len(curves)))
    running = {}  # our trial number -> (optuna trial, next step)
    verdicts = []
    rng = np.random.default_rng(seed + 100)
    while waiting or running:
        while waiting and len(running) < parallel:
            t = waiting.pop(0)
            running[t] = [study.ask(), 1]
        t = int(rng.choice(sorted(running)))  # the next trial to report: any of the running
        trial, step = running[t]
        value = sign * curves[t][step - 1]
        trial.report(value, step)
        theirs = trial.should_prune()
        mine = ours.report(t, step, value)
        verdicts.append((t, step, theirs, mine))
        if theirs:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            del running[t]
        elif step == steps:
            study.tell(trial, value)
            ours.complete(t)
            del running[t]
        else:
            running[t][1] += 1
    return verdicts


@pytest.mark.parametrize("name,options", [
    ("median", {}),
    ("median", {"n_startup_trials": 2, "n_warmup_steps": 3, "interval_steps": 2}),
    ("median", {"n_startup_trials": 0, "n_min_trials": 3}),
    ("asha", {"min_resource": 1, "reduction_factor": 2}),
    ("asha", {"min_resource": 2, "reduction_factor": 3, "min_early_stopping_rate": 1}),
    ("asha", {}),  # min_resource 'auto'
    ("asha", {"min_resource": 1, "reduction_factor": 3, "bootstrap_count": 2}),
    ("hyperband", {"min_resource": 1, "max_resource": 12, "reduction_factor": 3}),
    ("hyperband", {}),
])
@pytest.mark.parametrize("direction", ["minimize", "maximize"])
def test_same_verdicts_as_optuna(name, options, direction):
    for seed in range(3):
        verdicts = run_both(name, options, direction, seed)
        stopped = sum(v[2] for v in verdicts)
        assert [v[3] for v in verdicts] == [v[2] for v in verdicts], (seed, [
            v for v in verdicts if v[2] != v[3]][:5])
        if name != "asha" or options:  # 'auto' waits for a completed trial, then may prune little
            assert stopped > 0, "the schedule must exercise pruning"


def test_asha_follows_the_papers_rule_by_hand():
    # reduction factor 2, rungs at steps 1, 2, 4: the top half of each rung's arrivals goes on
    p = SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    assert not p.report(0, 1, 0.5)   # first at rung 0: alone, it is the top half
    assert p.report(1, 1, 0.9)       # 2 arrived, 0.9 is not in the best 1
    assert not p.report(2, 1, 0.1)   # best of 3: promoted (top 1 of 3)
    assert not p.report(2, 2, 0.1)   # first at rung 1
    assert p.report(3, 1, 0.7)       # of [0.5, 0.9, 0.1, 0.7] the best 2 are 0.1, 0.5
    assert not p.report(4, 1, 0.2)   # 0.2 is among the best 2 of 5
    assert p.report(4, 2, 0.3)       # rung 1: [0.1, 0.3] -> best 1 is 0.1
    assert not p.report(0, 2, 0.05)  # rung 1: 0.05 best of 3
    assert not p.report(0, 3, 0.05)  # between rungs: nothing to decide


def test_bad_pruner_options_name_the_option():
    with pytest.raises(UsageError, match="search.pruner_options.n_startup: not an option of the "
                                         "median pruner .did you mean 'n_startup_trials'"):
        make_pruner("median", n_startup=3)
    with pytest.raises(UsageError, match="reduction_factor must be an int >= 2"):
        make_pruner("asha", reduction_factor=1)
    with pytest.raises(UsageError, match="search.pruner is 'medain'"):
        make_pruner("medain")


@pytest.mark.parametrize("name", ["none", "median", "asha", "hyperband"])
def test_a_trial_completed_twice_counts_once_in_its_order(name):
    """A resumed sweep replays its journal's completions, and one may come again live."""
    pruner = make_pruner(name)
    for t in (3, 1, 3, 2, 1):
        pruner.complete(t)
    assert pruner.completed == [3, 1, 2]
