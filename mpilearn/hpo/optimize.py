"""python -m mpilearn.optimize: hyperparameter search over MPI.

    mpirun -np 1+B*K*R python -m mpilearn.optimize --config hpo.yaml [--resume]

Rank 0 is the coordinator (no device); B blocks each train one trial at a time, scored by
K-fold cross-validation with the K folds on R ranks each, in parallel (or in sequence with
``search.fold_mode: sequential``, np = 1+B*R). Outputs in the run directory:
``journal.jsonl`` (every event), ``config.yaml``, ``trials/<key>/fold<k>/`` (each fold's
own training run). ``--resume`` replays the journal, rebuilds the searcher and re-runs the
trials that were in flight, each fold from its own checkpoint; ``--resume auto`` also starts
a sweep that does not exist yet (requeued batch jobs); it refuses a changed config except
budget, trial_timeout, blocks, enqueue unless --force (hpo/identity.py). SIGTERM, SIGINT or
SIGUSR1 stops the sweep: no new trials, folds in flight checkpoint after their current step,
exit status 75. Under ``mpirun --with-ft ulfm`` with ``search.elastic`` a lost block rank costs
its trial, and a lost coordinator ends the survivors with 75 (hpo/elastic.py). A sweep in
which no trial succeeded exits 4; its last line names the most
common failure and where that trial's traceback and output are.
Then ``python -m mpilearn.report RUN_DIR``, and ``python -m mpilearn.refit RUN_DIR`` (or
``python -m mpilearn.optimize --refit RUN_DIR``) for the final model: the best trial trained on
all data, scored on ``search.test_files``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from ..cluster.launcher import RankZeroArgumentParser
from ..core import comm as mcomm
from ..cluster import preempt, stage
from ..core.comm import check_on_root
from ..errors import SweepFailed, UsageError, exit_status
from . import layout
from . import elastic
from .coordinator import TAG_BLOCK, TAG_PROGRESS, TAG_TRIAL, TAG_VERDICT, Coordinator
from ..core.membership import lost
from .pruners import make_pruner


def check_search(config: dict, build: bool = True) -> dict:
    """Every check of the sweep that reads no data file and no run directory: the budget,
    objective, model, hyperparameters, space, searcher, pruner and enqueued points. Also what
    ``python -m mpilearn.jobs`` checks before it renders a sweep's job (cluster/jobcheck.py),
    with ``build=False``: the model file is imported, not built (a builder may need the
    job's MPI context). Returns the parts built on the way."""
    from . import objective
    from .searchers import choose, make_searcher
    from .space import Space
    from ..core.builders import default_hparams, load_builder

    s = config["search"]
    if s["budget"] < 1:
        raise UsageError(f"search.budget must be at least 1, got {s['budget']}")
    obj = objective.parse(config)
    defaults, declared, task = {}, {}, None
    if "callable" not in obj:
        if not config["model"]:
            raise UsageError("no model given: set 'model' (or a search.objective.function)")
        from ..train.checks import check_hparams

        declared = default_hparams(config["model"])
        check_hparams(config["model"], config["hparams"])
        defaults = {**declared, **config["hparams"]}
    if "callable" not in obj and build:
        try:
            task = load_builder(config["model"])(defaults)
        except UsageError:
            raise
        except Exception as err:  # the builder's own error, before any trial
            raise UsageError(f"model {config['model']}: build(hparams) failed with the default "
                             f"hyperparameters: {type(err).__name__}: {err}") from None
        from ..train.callbacks import logged_metrics

        names = logged_metrics(task, config) | {objective.WALL}
        for metric in obj["metrics"]:
            if metric not in names:
                raise UsageError(f"search.objective.metric '{metric}' is never logged by "
                                 f"this model and config (logged: {', '.join(sorted(names))})")
    if "callable" not in obj:
        if config["data"]["test_files"]:
            raise UsageError("data.test_files in a sweep: give them as search.test_files (never "
                             "read by the search; python -m mpilearn.refit scores them)")
    elif config["model"]:  # a callable objective may still name a model: its defaults
        defaults = {**default_hparams(config["model"]), **config["hparams"]}
    space = Space.from_config(s["space"], defaults,
                              known=set(declared) if "callable" not in obj else None)
    if "callable" not in obj:
        check_space_values(config["model"], space)
    n_objectives = len(obj["directions"])
    name = choose(s["searcher"], n_objectives)  # 'auto': by the number of objectives
    searcher = make_searcher(name, space, s["seed"], n_objectives, **s["options"])
    if s["pruner"] != "none" and n_objectives > 1:
        raise UsageError(f"search.pruner {s['pruner']} judges one objective; this sweep has "
                         f"{n_objectives} (set search.pruner: none)")
    pruner = make_pruner(s["pruner"], obj["directions"][0], **s["pruner_options"])
    check_points(s["enqueue"], space)
    from . import elastic

    elastic.check(config)
    return {"objective": obj, "task": task, "searcher": searcher, "searcher_name": name,
            "pruner": pruner}


def plan(config: dict, world_size: int, resume, force: bool = False) -> dict:
    """Rank 0, before anything is written or any trial runs: every check of the sweep (layout,
    space, searcher, objective, data, model, output, and on ``--resume`` the config against
    the sweep's: ``hpo/identity.py``). Returns the plan: what :func:`start` records, and the
    coordinator's parts, built once here (objective, searcher, pruner, warm-start records)."""
    from . import identity
    s = config["search"]
    layout.check(world_size, s["blocks"], s["folds"], s["ranks_per_fold"], s["fold_mode"])
    asked = s["searcher"]
    parts = check_search(config)
    # 'auto' becomes the searcher it picked, before config.yaml is written or compared on
    # --resume: the sweep keeps one searcher, named in its files
    s["searcher"] = parts["searcher_name"]
    task, n_events = parts["task"], None
    if task is not None:
        from ..data.hdf5 import EventFiles
        from ..train.checks import expand_files

        files = EventFiles(expand_files(config["data"]["files"]), task.keys, task.optional_keys)
        if hasattr(task, "check_files"):
            task.check_files(files)
        test = set(map(os.path.abspath, expand_files(s["test_files"], "search.test_files")))
        overlap = test & set(map(os.path.abspath, files.paths))
        if overlap:
            raise UsageError(f"test file(s) in data.files: {', '.join(sorted(overlap))}; the "
                             "test files must never enter the search")
        n_events = len(files)
    warm = warm_start(s["warm_start"])
    output = config["output"] or "runs/hpo"
    from ..train.checks import check_output

    check_output(output)
    journal = os.path.join(output, "journal.jsonl")
    if os.path.exists(journal) and not resume:
        raise UsageError(f"{output} already holds a sweep: use --resume, or another --output")
    if resume == "latest" and not os.path.exists(journal):
        raise UsageError(f"--resume: no sweep in {output} (no {journal}); --resume auto starts "
                         "one when there is none")
    # one line per sweep: its folds start fresh without saying so, each one
    notes = identity.check(output, config, force) if os.path.exists(journal) else \
        [f"mpilearn: no sweep in {output}; starting one"] if resume == "auto" else []
    if asked == "auto" and s["searcher"] != "gp":  # gp, the old default, needs no line
        notes.append(f"mpilearn: search.searcher auto: {s['searcher']} "
                     f"({len(parts['objective']['directions'])} objectives)")
    return {"output": output, "n_events": n_events, "notes": notes, "force": force,
            "objective": parts["objective"], "searcher": parts["searcher"],
            "pruner": parts["pruner"], "warm_start": warm}


def start(plan: dict, config: dict) -> dict:
    """Rank 0, after the plan: the run directory and the config in force (``config.yaml``,
    ``config-history/``). Returns what every rank needs."""
    from . import identity

    os.makedirs(plan["output"], exist_ok=True)
    number, path = identity.record(plan["output"], config)
    return {"output": plan["output"], "n_events": plan["n_events"], "notes": plan["notes"],
            "force": plan["force"], "config": number, "config_path": path}


def check_space_values(model: str, space) -> None:
    """The space's bounds and choices lie inside the values the model declares (``HPARAMS``):
    a sweep whose trials would fail on a bad value is bad input before it starts."""
    from ..core.builders import check_value, declared_values

    rules = declared_values(model)
    for p in space.params:
        if p.name not in rules:
            continue
        ends = p.choices if p.type == "categorical" else (p.low, p.high)
        for value in ends:
            try:
                check_value(p.name, value, rules[p.name])
            except UsageError as err:
                raise UsageError(f"search.space.{p.name}: {err}") from None


def check_points(points, space) -> None:
    """``search.enqueue``: every point names each parameter of the space, inside its range."""
    for i, point in enumerate(points):
        where = f"search.enqueue[{i}]"
        if not isinstance(point, dict) or set(point) != set(space.names):
            raise UsageError(f"{where} must give exactly the space's parameters "
                             f"({', '.join(space.names)}), got {point!r}")
        for p in space.params:
            v = point[p.name]
            ok = v in p.choices if p.type == "categorical" else (
                isinstance(v, (int, float)) and not isinstance(v, bool) and p.low <= v <= p.high
                and (p.type == "real" or float(v).is_integer()))
            if not ok:
                raise UsageError(f"{where}.{p.name} is {v!r}: outside the space ("
                                 + (f"choices {p.choices}" if p.type == "categorical"
                                    else f"{p.type} in [{p.low:g}, {p.high:g}]") + ")")


def warm_start(run_dirs) -> list:
    """The finished trials of earlier sweeps (``search.warm_start``): their ``done`` records."""
    from .journal import Journal

    records = []
    for run_dir in run_dirs:
        path = os.path.join(run_dir, "journal.jsonl")
        if not os.path.exists(path):
            raise UsageError(f"search.warm_start: {path} not found (give a sweep's run directory)")
        state = Journal(path).replay()
        records += [{**r, "params": state.started[k]["params"]}
                    for k, r in state.finished.items() if r["status"] == "done"]
    return records


def run_block(config: dict, role, world, info: dict) -> str:
    """Every non-coordinator rank: take trials from the coordinator until told to stop
    (no trial left, or a stop signal). Returns the kind of device it trained on."""
    from . import objective

    s = config["search"]
    obj = objective.parse(config)
    if s["elastic"]:
        elastic.returning_errors(world)  # the communicators split from it inherit it
    block_comm = world.Split(role.block, role.block_rank)
    workers = world.Split(1, world.Get_rank())  # everyone but the coordinator (color 0)
    local = workers.Split_type(mcomm.mpi().COMM_TYPE_SHARED, key=workers.Get_rank())
    if s["fold_mode"] == "parallel":
        fold_comm = block_comm.Split(role.fold_group, role.fold_rank)
        my_folds = [role.fold_group]
    else:
        fold_comm = block_comm
        my_folds = list(range(s["folds"]))
    # device binding follows the node-local rank among all workers, not within a fold
    ctx = mcomm.Context(comm=fold_comm, local_comm=local)
    mcomm.gpus_are_per_task(ctx)  # the one collective on the node, while every block is here
    watch = elastic.BlockWatch(block_comm) if s["elastic"] else None
    try:
        serve_trials(config, role, world, info, obj, block_comm, fold_comm, ctx, my_folds,
                     watch)
    except Exception as err:  # noqa: BLE001 - only MPI's report of a lost rank is handled
        if not (s["elastic"] and (lost(err, fold_comm) or lost(err, block_comm))):
            raise
        # a rank lost (the coordinator, or one of this block's): the block retires
        elastic.retire(world, [block_comm, fold_comm], role.block, info.get("hosts"),
                       TAG_BLOCK)
    finally:
        if watch is not None:
            watch.close()
    return "gpu" if str(ctx.device).startswith("cuda") else "cpu"


def serve_trials(config, role, world, info, obj, block_comm, fold_comm, ctx, my_folds,
                 watch=None) -> None:
    """The block's loop: its leader asks the coordinator for a trial, the block trains it
    (each fold of it on its fold's ranks), the leader sends the result with the next ask."""
    from . import objective

    s = config["search"]
    result = None
    while True:
        trial = None
        if role.block_rank == 0:
            world.send({"block": role.block, "result": result}, dest=0, tag=TAG_BLOCK)
            trial = mcomm.recv_idle(world, 0, TAG_TRIAL)
        mcomm.wait_idle(block_comm)
        trial = block_comm.bcast(trial, root=0)
        if trial is None:
            return
        folds = []
        for fold in my_folds:
            out = os.path.join(info["output"], "trials", trial["key"], f"fold{fold}")
            on_epoch = _reporter(world, fold_comm, obj, trial["key"], fold) \
                if s["pruner"] != "none" else None
            r = objective.run_fold(config, trial["params"], fold, ctx, out, obj,
                                   info["n_events"], on_epoch, key=trial["key"],
                                   prior_wall=trial.get("prior_wall", {}).get(fold, 0.0),
                                   force=info["force"],
                                   watch=watch.check if watch is not None else None)
            # the fold's cost: its ranks x wall (device_hours in the journal)
            folds.append({"fold": fold, **r, "ranks": fold_comm.Get_size(),
                          "device": "gpu" if str(ctx.device).startswith("cuda") else "cpu"})
        # the block leader collects every fold leader's results (a fold done early waits
        # asleep: on a shared CPU node its ranks would spin on the cores the others train on)
        mcomm.wait_idle(block_comm)
        gathered = block_comm.gather(folds if fold_comm.Get_rank() == 0 else [], root=0)
        if role.block_rank == 0:
            flat = sorted((f for part in gathered for f in part), key=lambda f: f["fold"])
            walls = [f["wall"] for f in flat]  # folds one after another, or side by side
            result = {"folds": flat,
                      "wall": sum(walls) if s["fold_mode"] == "sequential" else max(walls)}


def _reporter(world, fold_comm, obj, key, fold):
    """Per-epoch callback: the fold leader sends the objective's value and asks the coordinator
    whether to go on. Collective over the fold for training; a function objective calls it on
    the fold leader alone."""
    from .objective import PRUNE_KEY

    metric = PRUNE_KEY if obj["metrics"] is None else obj["metrics"][0]

    def report(record):
        stop = False
        if fold_comm.Get_rank() == 0 and record.get(metric) is not None:
            world.send({"key": key, "fold": fold, "epoch": record["epoch"],
                        "value": float(record[metric])}, dest=0, tag=TAG_PROGRESS)
            stop = world.recv(source=0, tag=TAG_VERDICT)
        return stop if obj["metrics"] is None else fold_comm.bcast(stop, root=0)

    return report


def summary(state, obj, coordinator, output: str) -> str:
    from collections import Counter

    counts = Counter(r["status"] for r in state.finished.values())
    origins = Counter(state.started[k].get("origin") or "requeued" for k in state.started)
    done = [r for r in state.finished.values() if r["status"] == "done"]
    sign = obj["signs"][0]
    best = min(done, key=lambda r: sign * r["value"]) if done and len(obj["signs"]) == 1 else None
    verb = "stopped" if coordinator.stop_requested else "finished"
    return (f"mpilearn: sweep {verb}: {len(state.finished)} trials ("
            + ", ".join(f"{counts[s]} {s}" for s in ("done", "pruned", "failed") if counts[s]
                        or s != "pruned") + ")"
            + (f"; best {best['value']:.5g} with {best['params']}" if best else "")
            + f"; suggestions: {', '.join(f'{n} {o}' for o, n in sorted(origins.items()))}"
            + f"; results in {output}")


def no_success(state, output: str):
    """Why a sweep in which no trial succeeded failed (the message of ``SweepFailed``): its
    most common failure, and where the last trial that failed so logged it; None if a trial
    succeeded."""
    from collections import Counter

    finished = list(state.finished.values())
    failed = [r for r in finished if r["status"] == "failed"]
    if not failed or any(r["status"] == "done" for r in finished):
        return None
    first_line = [r["reason"].splitlines()[0] for r in failed]
    reason, count = Counter(first_line).most_common(1)[0]
    last = failed[len(first_line) - 1 - first_line[::-1].index(reason)]
    key = last["key"]
    run = os.path.join(output, "trials", key)
    return (f"no trial succeeded: {count} of {len(finished)} failed with {reason}; the last "
            f"of them, trial {key}, has its traceback in {os.path.join(output, 'journal.jsonl')}"
            f" (its 'failed' event), its output in the lines marked [trial {key} fold N]"
            + (f" and its runs in {run}" if os.path.isdir(run) else ""))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--refit" in argv:  # --refit RUN [--trial KEY]: the same as python -m mpilearn.refit RUN
        from .refit import main as refit

        argv.remove("--refit")
        return refit(argv)
    from ..core.config import SEARCH, help_keys

    p = RankZeroArgumentParser(prog="python -m mpilearn.optimize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="search keys (the training keys: python -m mpilearn.train "
                                       "--help), default, meaning:\n"
                                       + help_keys({"search": SEARCH}))
    p.add_argument("--config", required=True, help="sweep config (YAML): training keys + 'search'")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--output", help="run directory (overrides 'output')")
    p.add_argument("--resume", nargs="?", const="latest", choices=("latest", "auto"),
                   help="continue the sweep in the run directory; 'auto': or start it")
    p.add_argument("--force", action="store_true",
                   help="with --resume: continue although the config changed in what the "
                        "trials are (space, searcher, objective, folds, data, model, training)")
    p.add_argument("--no-progress", action="store_true")
    from ..train.__main__ import add_force_unlock

    add_force_unlock(p)
    args = p.parse_args(argv)
    preempt.install()
    from ..core import startup

    # under ULFM, a rank lost before MPI_Init returned would hold the others there for ever:
    # the guard bounds it, and mpilearn-run sees its phases (core/startup.py); after it, a lost
    # rank is MPI's to report (the sweep's own handling: hpo/elastic.py)
    guard = startup.arm()
    ctx = mcomm.init()
    guard.started()
    world = ctx.comm
    stage.leave_on_exit(ctx.local_rank)
    try:
        line = mcomm.check_launch(ctx)
        if ctx.rank == 0:
            print(line, flush=True)
        from ..core.config import hpo_schema, resolve

        sets = list(args.set) + ([f"output={args.output}"] if args.output else [])
        config = resolve(args.config, sets, schema=hpo_schema(), require_model=False)
        from ..core import runlock

        # plan (every check, one verdict from rank 0); one writer per sweep directory: the
        # lock comes before anything is written there; then build from the plan
        planned = check_on_root(world, plan, config, world.Get_size(), args.resume, args.force)
        runlock.hold(world, config["output"] or "runs/hpo", args.force_unlock)
        info = world.bcast(start(planned, config) if ctx.rank == 0 else None, root=0)
        for note in info["notes"] if ctx.rank == 0 else ():
            print(note, flush=True)
        # what the job costs from here is every rank's wall time: start-up so far, then
        # the time since (journalled as 'job', then 'job_end'; hpo/cost.py)
        from ..train.launches import process_age

        startup = world.gather(process_age(), root=0)
        launched_at = time.monotonic()
        if config["search"]["elastic"]:  # a lost rank's host, named by the one who sees it
            import socket

            info["hosts"] = world.allgather(socket.gethostname())
    except Exception as err:  # mpilearn's own errors become statuses; others abort the job
        return preempt.leave(exit_status(err, ctx.rank))
    s = config["search"]
    failure = None
    role = layout.role(world.Get_rank(), world.Get_size(), s["blocks"], s["folds"],
                       s["ranks_per_fold"], s["fold_mode"])
    if role.coordinator:
        if s["elastic"]:
            elastic.returning_errors(world)
        world.Split(mcomm.mpi().UNDEFINED, 0)  # block communicators: not ours
        world.Split(0, 0)                       # the workers' communicator: not ours
        from .journal import Journal

        journal = Journal(os.path.join(info["output"], "journal.jsonl"))
        state = journal.replay()
        obj = planned["objective"]
        coordinator = Coordinator(world, config, planned["searcher"], journal, state, s["blocks"],
                                  progress=not args.no_progress, pruner=planned["pruner"],
                                  objective=obj, warm_start=planned["warm_start"],
                                  config_id=info["config"],
                                  launch={"ranks": world.Get_size(), "startup_s": startup},
                                  elastic={"width": layout.sweep_width(config),
                                           "hosts": info["hosts"]} if s["elastic"] else None)
        state = coordinator.run()
        print(summary(state, obj, coordinator, info["output"]), flush=True)
        failure = no_success(state, info["output"])
        device = "cpu"  # the coordinator holds no device
    else:
        device = run_block(config, role, world, info)
    if s["elastic"]:  # the survivors of any lost rank go on as the job from here
        hosts = info["hosts"]
        world, coordinator_kept = elastic.survivors(ctx, world)
        if not coordinator_kept:
            if world.Get_rank() == 0:
                print(elastic.coordinator_lost_line(hosts[0], info["output"]), flush=True)
            return mcomm.leaving(preempt.leave(elastic.COORDINATOR_LOST_EXIT))
    # every rank leaves with the same status: 75 (requeue me) if any rank saw a stop signal
    stopped = world.allreduce(preempt.mask(), op=mcomm.mpi().BOR)
    devices = world.gather(device, root=0)
    if ctx.rank == 0:  # the journal's one writer (the coordinator) closes the job's cost
        from .journal import Journal

        now = time.monotonic() - launched_at
        Journal(os.path.join(info["output"], "journal.jsonl")).write(
            "job_end", devices=devices, launched_s=[round(a + now, 3) for a in startup])
    if stopped and ctx.rank == 0:
        journal = os.path.join(info["output"], "journal.jsonl")
        print(f"mpilearn: stopped by {preempt.describe(stopped)}; checkpoint {journal} (each "
              "interrupted fold has its own); continue with --resume auto", flush=True)
    if stopped:
        return mcomm.leaving(preempt.leave())
    failure = world.bcast(failure, root=0)  # every rank leaves with the status
    # decided: a stop signal during the exit must not turn it into 75 (preempt.leave)
    return mcomm.leaving(preempt.leave(exit_status(SweepFailed(failure), world.Get_rank())
                                       if failure else 0))


if __name__ == "__main__":
    sys.exit(main())
