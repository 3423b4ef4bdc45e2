"""python -m mpilearn.train: one data-parallel training run.

    mpirun -np 4 python -m mpilearn.train --config run.yaml --set train.epochs=10
    python -m mpilearn.train --demo               # the embedded demo job (what make demo runs)
    mpirun -np 4 python -m mpilearn.train --config run.yaml --output runs/a --resume
    srun python -m mpilearn.train --config run.yaml --output runs/a --resume auto   # batch jobs
"""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import UsageError, exit_status
from ..cluster.launcher import RankZeroArgumentParser
from ..core.config import help_keys

# the key list comes from the config's one schema (core/config.DESCRIPTIONS), as the docs' does
EPILOG = """\
config keys (YAML; --set uses dotted names), default, meaning:
""" + help_keys() + """

outputs in the run directory: config.yaml, metrics.jsonl (one line per epoch),
launches.jsonl (each launch's wall time per rank: python -m mpilearn.report RUN),
checkpoints/ (latest pointer + ckpt-eEEEE-sSSSSSSS.pt, best.pt), models/ (and models/best/).
one writer: the run directory's .mpilearn.lock names the job that writes it; a second job
exits 2 naming it (a requeued job takes its own lock back; a dead holder's is taken over).
signals: SIGTERM, SIGINT or SIGUSR1 on any rank -> checkpoint after the current step, exit 75
(through Open MPI's mpirun: launch with mpilearn-run, or send mpirun SIGUSR1); during start-up,
before the first step: nothing to save, one line, exit 75 too.
exit status: 0 done, 1 crash (the failing rank's traceback), 2 bad input,
3 training stopped by its guard (e.g. the generator emits only empty images, a data read
failed), 124 a rank stuck (the watchdog: its stack in RUN/watchdog-rankR.txt),
75 stopped by a signal with its state saved, or an elastic run that lost ranks (below
train.elastic.min_ranks: checkpointed; during start-up: nothing to save): requeue and run
again with --resume auto.
"""


def parse_args(argv=None):
    p = RankZeroArgumentParser(
        prog="python -m mpilearn.train", description="Data-parallel training over MPI.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file; without one, the documented defaults "
                                     "and --set")
    p.add_argument("--demo", action="store_true",
                   help="the embedded demo job (the small 3DGAN on synthetic showers, simulated "
                        "once into the cache) as the base under --config and --set")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.epochs=3 (repeatable)")
    p.add_argument("--output", help="run directory (overrides the 'output' key)")
    p.add_argument("--resume", nargs="?", const="latest", choices=("latest", "auto"),
                   help="continue from the latest checkpoint in the run directory; with "
                        "'auto', start fresh when there is none (requeued batch jobs)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run in the run directory (its config, metrics, "
                        "checkpoints, validation and models)")
    p.add_argument("--force", action="store_true",
                   help="with --resume: continue although the config changed in what is "
                        "trained (the changes are listed)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    add_force_unlock(p)
    return p.parse_args(argv)


def add_force_unlock(p) -> None:
    p.add_argument("--force-unlock", action="store_true",
                   help="take the run directory's lock although its holder (named) may still "
                        "write there: only when that job is surely gone")


def main(argv=None) -> int:
    args = parse_args(argv)

    def config(ctx):
        from ..core.config import resolve

        base = None
        if args.demo:
            from ..calo.demo import default_config, ensure_data

            base = default_config()
            ensure_data(ctx.comm)
        return resolve(args.config, args.set, base)

    return run(args, config)


def run(args, make_config, after=None) -> int:
    """The body of every command that trains one run (this one, ``mpilearn.hpo.refit``): stop
    signals, MPI, the launcher check, ``make_config(ctx)``, the Trainer, then
    ``after(ctx, last epoch record)``; the exit status.

    Start-up (``core/startup.py``): the stop signals' handler and the start-up guard come
    first, then ``MPI_Init``, and only then the heavy imports (torch): under ULFM a rank lost
    before it joined ``MPI_Init`` leaves the others waiting there, which only the guard's
    bound ends, while a loss after it is MPI's to report, and the survivors end start-up with
    one line and exit 75 (the membership made at once: ``Membership.early``)."""
    from ..cluster import preempt
    from ..core import startup

    preempt.install()
    guard = startup.arm()
    from ..cluster import stage
    from ..core import comm as mcomm
    from ..core import membership
    from . import elastic

    mcomm.mpi()  # MPI_Init
    guard.mpi_up()
    guard.phase(startup.IMPORTS)
    if startup.ulfm() and not startup.spawned() and membership.supported():
        membership.Membership.early(mcomm.mpi().COMM_WORLD)
    ctx = launches = None  # launches: the wall time per rank (launches.jsonl), once built
    try:
        ctx = mcomm.init()
        if membership.current() is not None:  # (Membership.early)
            membership.current().follow(ctx)
            membership.current().gather_hosts()
        stage.leave_on_exit(ctx.local_rank)
        merged = membership.joined()
        if merged is not None:  # spawned by a running job to join it (an elastic growth)
            return _newcomer(ctx, merged)
        from .stops import before_start

        line = mcomm.check_launch(ctx)
        if ctx.rank == 0:
            print(line, flush=True)
        # a stop signal during start-up ends the run at one of two checks, with nothing to
        # save: here, before the heavy imports and the config, and once the Trainer is built
        before_start(ctx.comm)
        guard.phase(startup.CONFIG)
        config = make_config(ctx)
        # an elastic run: a rank lost from here on ends start-up with one line and exit 75
        # (its in-memory cover begins with the first snapshot; docs/guide/elastic.md)
        guard.phase(startup.MEMBERSHIP)
        elastic.join(ctx, config)
        guard.started()
        if args.resume and not (args.output or config["output"]):
            raise UsageError("--resume needs the run directory: --output DIR")
        from ..core import runlock
        from ..core.comm import check_on_root
        from .checks import check_output, default_output
        from .engine import Trainer

        # one writer per run directory: the lock comes before anything is written there
        output = ctx.comm.bcast(args.output or config["output"] or default_output(config))
        if ctx.rank == 0:  # where a relaunch resumes (mpilearn-run)
            mcomm.record_output(os.path.abspath(output))
        check_on_root(ctx.comm, check_output, output)
        runlock.hold(ctx.comm, output, args.force_unlock)
        resume = {None: False, "latest": True, "auto": "auto"}[args.resume]
        trainer = Trainer(config, ctx, output=output, resume=resume,
                          progress=not args.no_progress, overwrite=args.overwrite,
                          force=args.force)
        trainer.spawn_command = membership.spawned_command()
        from .launches import Launches

        launches = Launches(ctx.comm, output, ctx.device)
        trainer.callbacks.append(launches)
        before_start(ctx.comm)
        last = trainer.fit()
        if after is not None:
            after(ctx, last)
    except Exception as err:  # mpilearn's own errors become statuses; others abort the job
        err = elastic.outside_training(err)
        m = membership.current()
        rank = ctx.rank if ctx is not None else m.rank if m is not None else \
            mcomm.mpi().COMM_WORLD.Get_rank()
        status = exit_status(err, rank)
        if launches is not None:
            launches.write(status)
        guard.leaving()
        if ctx is None:  # lost before MPI's set-up here ended: there is no exit barrier yet
            mcomm.exit_without_finalize(_leaving(rank, status))
        return _leaving(ctx.rank, status)
    launches.write(0)
    guard.leaving()
    # finished: a stop signal from here on (its exit takes seconds) has nothing to stop
    return _leaving(ctx.rank, 0)


def _leaving(rank: int, status: int) -> int:
    """The process's exit status: ``status``, recorded for the launcher by rank 0 of an
    elastic run (``comm.record_end``), after the stop signals' and the exit guard's say."""
    from ..cluster import preempt
    from ..core import comm as mcomm, membership

    if rank == 0 and membership.current() is not None:
        mcomm.record_end(status)
    return mcomm.leaving(preempt.leave(status))


def _newcomer(ctx, merged) -> int:
    """A rank that a running job spawned: no checks, no run-directory work, no lock (the
    job's rank 0 holds it and writes); its Trainer comes from rank 0's plan and joins the
    job at the step where it grew, then trains to the end with the others."""
    from ..core import comm as mcomm
    from .engine import Trainer

    # the exit barrier with the job (a lone newcomer's own world has no other rank to wait for)
    if "comm" not in mcomm._EXIT_GUARD:
        mcomm.install_exit_guard(mcomm.mpi().COMM_WORLD)
    try:
        Trainer.newcomer(ctx, merged).fit()
    except Exception as err:  # as a launched rank's: statuses, one message from rank 0
        return _leaving(ctx.rank, exit_status(err, ctx.rank))
    return _leaving(ctx.rank, 0)


if __name__ == "__main__":
    sys.exit(main())
