"""python -m mpilearn.jobs: render a SLURM batch script from a run config and a site profile.

    python -m mpilearn.jobs --kind train --config jobs/train-3dgan.yaml --site site.yaml \\
        --nodes 4 --time 12:00:00 > train.sbatch
    sbatch train.sbatch

The script activates the site's modules (opt-in) and virtual environment, launches with
``srun`` or ``mpirun``, forwards the early-warning signal (``--signal=B:USR1@grace``) to every
rank, and requeues itself when mpilearn exits 75 (stopped with its state saved), and after a
crash (a killed rank, the OOM killer, a stuck rank's watchdog) up to the site's
``max_restarts`` times; the next run picks up with ``--resume auto``. Bad input (2) and a run
that its guard stopped (3, 4) would fail again: never requeued. The ``#SBATCH`` lines are defaults: the rank count and the
nodes come from the allocation at job start (``--plan``), so ``sbatch --ntasks/--nodes/...``
resize a job. The scripts in ``jobs/`` are this command's output for ``jobs/site-example.yaml``.

Stopping a job (every rank checkpoints after its current step, then the job ends):
  scancel JOB                        stop for good: the job stays CANCELLED and says where its
                                     checkpoint is; sbatch the same script again to continue
  scancel --batch --signal=USR1 JOB  checkpoint and requeue now (what the time-limit warning
                                     does); scontrol requeue JOB also requeues it (by SLURM)
  MPILEARN_REQUEUE=0 sbatch ...      never requeue itself, not even at the time limit (chains:
                                     jobs/chain.sh); the default 1 requeues a job that stopped
                                     with its state saved while it still runs
A preempted job (PreemptMode=REQUEUE) is requeued by SLURM and resumes. A run directory has
one writer: a second job on it exits 2 naming the first (--force-unlock overrides). The
node-local stage (stage_to) and the host file go when the job ends; those of jobs that died
without clean-up are removed by the next job.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import shlex
import sys

from ..errors import UsageError
from ..hpo.layout import sweep_tasks, sweep_width
from .shell import ENTRY, WAIT_FOR_LAUNCHER, ulfm_flag

# the site profile: key -> default (the default's type is the type the key accepts)
SITE = {
    "partition": "",          # empty: the cluster's default partition
    "account": "",
    "qos": "",
    "modules": [],            # module load ... (in order); none: no module command at all
    "module_purge": False,    # module purge before loading (breaks Cray environments)
    "venv": "",               # virtual environment to activate; default $SLURM_SUBMIT_DIR/.venv
    "launcher": "srun",       # srun | mpirun
    "srun_mpi": "pmix",       # srun --mpi=... (pmix, pmi2; see srun --mpi=list)
    "mpirun_args": "",        # extra mpirun flags, e.g. "--mca btl ^openib"
    "nodes": 1,
    "tasks_per_node": 0,      # 0: one task per GPU with gpus_per_node, else 2
    "gpus_per_node": 0,
    "cpus_per_task": 0,       # 0: leave it to the cluster
    "time": "01:00:00",
    "signal_grace": 300,      # seconds before the time limit at which mpilearn checkpoints
    "max_restarts": 3,        # requeues after a crash (a rank killed, OOM, the watchdog's 124);
                              # 0: none. Bad input (2), a stopped run (3, 4) never requeue
    "stage_to": "",           # node-local directory to copy the data files to (e.g. /tmp)
    "sbatch": [],             # extra #SBATCH lines, e.g. ["--constraint=a100"]
    "price": {},              # {gpu_hour, cpu_hour, currency}: cluster/price.py (the report)
    # kubernetes: {...}        the MPIJob's settings (--target kubernetes): cluster/kubernetes.py
}

# where a stopped job's state is, as the batch script names it
SAVED = {"train": '"$OUTPUT/checkpoints/$(cat "$OUTPUT/checkpoints/latest" 2>/dev/null)"',
         "hpo": '"$OUTPUT/journal.jsonl (and each interrupted fold\'s checkpoints)"'}

# the ready scripts in jobs/: file -> (kind, config, launcher), rendered for site-example.yaml
EXAMPLES = {
    "train.sbatch": ("train", "jobs/train-3dgan.yaml", "srun"),
    "train-mpirun.sbatch": ("train", "jobs/train-3dgan.yaml", "mpirun"),
    "hpo.sbatch": ("hpo", "jobs/hpo-mlp.yaml", "srun"),
    "hpo-mpirun.sbatch": ("hpo", "jobs/hpo-mlp.yaml", "mpirun"),
}


def load_site(path: str | None, overrides: dict) -> dict:
    from ..core.config import _check, load_file

    from . import price

    site = copy.deepcopy(SITE)
    site["kubernetes"] = {}  # checked when rendered for Kubernetes (kubernetes.profile)
    site["price"] = price.parse({}, "site")
    for layer, source in ((load_file(path) if path else {}, path or "site"),
                          ({k: v for k, v in overrides.items() if v is not None}, "command line")):
        site["kubernetes"].update(layer.pop("kubernetes", None) or {})
        if "price" in layer:
            site["price"] = price.parse(layer.pop("price"), source)
        _check(layer, SITE, "", source)
        site.update(layer)
    if site["launcher"] not in ("srun", "mpirun"):
        raise UsageError(f"site: 'launcher' is {site['launcher']!r}; choose srun or mpirun")
    if site["nodes"] < 1:
        raise UsageError(f"site: 'nodes' must be at least 1, got {site['nodes']}")
    if site["max_restarts"] < 0:
        raise UsageError(f"site: 'max_restarts' must be 0 (never) or more, got "
                         f"{site['max_restarts']}")
    if site["tasks_per_node"] < 0:
        raise UsageError(f"site: 'tasks_per_node' must be 0 (auto) or more, got "
                         f"{site['tasks_per_node']}")
    return site


def layout(kind: str, config: dict, site: dict) -> dict:
    """The render-time defaults of the #SBATCH header: nodes and tasks per node."""
    nodes, per_node, gpus = site["nodes"], site["tasks_per_node"], site["gpus_per_node"]
    per_node = per_node or gpus or 2  # auto: one rank per GPU
    if kind == "train":
        return {"ntasks": nodes * per_node, "per_node": per_node, "hosts": None}
    workers = sweep_tasks(config) - 1
    if gpus and workers != nodes * gpus:
        raise UsageError(
            f"the sweep has {workers} training ranks (search.blocks x folds x ranks_per_fold) but "
            f"{nodes} node(s) x {gpus} GPU(s) = {nodes * gpus}: make them equal (the coordinator "
            "takes no GPU and shares the first node)")
    per_node = math.ceil(workers / nodes)
    # the coordinator is one extra task on the first node; the rest fill nodes in order. The
    # header asks --ntasks (the total) with --ntasks-per-node as the most on one node, so
    # only the first node is allocated the extra task (sbatch: --ntasks takes precedence and
    # --ntasks-per-node is then a maximum)
    return {"ntasks": workers + 1, "per_node": per_node + 1,
            "hosts": [per_node + 1] + [per_node] * (nodes - 1)}


def _launch(kind: str, site: dict, lay: dict, config: dict) -> list:
    """The lines that size the job from its allocation and start the ranks."""
    plan = (f'NTASKS=$(python -m mpilearn.jobs --plan --kind {kind} --launcher '
            f'{site["launcher"]} --config "$CONFIG" --hostfile "$HOSTFILE" "$@") || exit 2')
    lines = ['HOSTFILE="$OUTPUT/hosts-$SLURM_JOB_ID"', plan]
    if site["launcher"] == "srun":
        launch = f'srun --mpi={site["srun_mpi"]} --kill-on-bad-exit=1 --ntasks="$NTASKS"'
        if lay["hosts"]:  # the coordinator's extra task on the first node
            lines.append('export SLURM_HOSTFILE="$HOSTFILE"')
            launch += " --distribution=arbitrary"
        if ulfm_flag(kind, config):
            lines.insert(0, "# elastic (train.elastic.min_ranks): srun has no ULFM, so a lost rank "
                            "ends the step; the job requeues (max_restarts) and resumes at the "
                            "exact data position on the ranks it then has")
    else:
        launch = ('mpirun -np "$NTASKS" --hostfile "$HOSTFILE" --map-by slot --bind-to none'
                  + ulfm_flag(kind, config))
        if site["stage_to"]:
            launch += " -x MPILEARN_STAGE"
        launch += f" {site['mpirun_args']}" if site["mpirun_args"] else ""
    return lines + [launch]


def render(kind: str, config_path: str, output: str, config: dict, site: dict, sets=()) -> str:
    """The batch script; ``sets`` (render-time --set KEY=VALUE) go into the run's command, so
    the job runs the config that was checked and rendered (as the MPIJob's launcher does)."""
    lay = layout(kind, config, site)
    q = shlex.quote
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=mpilearn-{kind}",
             f"#SBATCH --nodes={site['nodes']}"]
    if lay["hosts"]:  # a sweep: the total, and at most the first node's share on any node
        lines.append(f"#SBATCH --ntasks={lay['ntasks']}")
    lines.append(f"#SBATCH --ntasks-per-node={lay['per_node']}")
    if site["gpus_per_node"]:
        lines.append(f"#SBATCH --gpus-per-node={site['gpus_per_node']}")
    if site["cpus_per_task"]:
        lines.append(f"#SBATCH --cpus-per-task={site['cpus_per_task']}")
    for key in ("partition", "account", "qos"):
        if site[key]:
            lines.append(f"#SBATCH --{key}={site[key]}")
    lines += [f"#SBATCH --time={site['time']}",
              f"#SBATCH --signal=B:USR1@{site['signal_grace']}",
              "#SBATCH --requeue",
              "#SBATCH --open-mode=append",
              "#SBATCH --output=%x-%j.out"]
    lines += [f"#SBATCH {extra}" for extra in site["sbatch"]]
    modules = " ".join(site["modules"])
    venv = site["venv"] or "$SLURM_SUBMIT_DIR/.venv"
    purge = "module purge && " if site["module_purge"] else ""
    lines += [
        f"# rendered by: python -m mpilearn.jobs --kind {kind} (launcher: {site['launcher']})",
        "# usage: sbatch [sbatch flags] THIS_SCRIPT [CONFIG [OUTPUT [mpilearn flags...]]]",
        "# the #SBATCH sizes are defaults: the ranks follow the allocation (sbatch --ntasks, "
        "--nodes, --ntasks-per-node, --gpus-per-node)",
        "# env: MPILEARN_VENV, MPILEARN_MODULES, MPILEARN_REQUEUE=0 (chains: jobs/chain.sh)",
        "set -uo pipefail",
        f'CONFIG=${{1:-{q(config_path)}}}',
        f'OUTPUT=${{2:-{q(output)}}}',
        "shift $(( $# < 2 ? $# : 2 ))",
        f'MODULES=${{MPILEARN_MODULES-{q(modules)}}}',
        f'VENV=${{MPILEARN_VENV:-{venv}}}',
        f'if [ -n "$MODULES" ]; then {purge}module load $MODULES; fi',
        'source "$VENV/bin/activate"',
        "# threads per rank: --cpus-per-task when given, else mpilearn's cores / ranks per node",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK; '
        'else unset OMP_NUM_THREADS; fi',
        "# srun does not pass the job's --cpus-per-task on to its steps (SLURM >= 22.05)",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi',
        'echo "mpilearn: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on '
        '${SLURM_JOB_NODELIST}: $CONFIG -> $OUTPUT"',
        'mkdir -p "$OUTPUT" || exit 2',
    ]
    if lay["hosts"]:
        lines.insert(lines.index("set -uo pipefail"),
                     f"# rendered for {lay['ntasks']} ranks = 1 coordinator + {lay['ntasks'] - 1} "
                     f"training ranks (the search section of {config_path}); at job start the "
                     "sweep's layout must fit the allocation")
    lines += _launch(kind, site, lay, config)
    launch = lines.pop()
    if site["stage_to"]:
        # one copy per node; the ranks read it (MPILEARN_STAGE), the run records the sources
        nodes = "srun --ntasks-per-node=1 --ntasks=$SLURM_JOB_NUM_NODES --kill-on-bad-exit=1"
        lines += [f'export MPILEARN_STAGE="{site["stage_to"]}/mpilearn-$SLURM_JOB_ID"',
                  f'unstage() {{ [ -n "${{MPILEARN_STAGE:-}}" ] && {nodes} rm -rf '
                  '"$MPILEARN_STAGE"; unset MPILEARN_STAGE; }',
                  "trap unstage EXIT",
                  f'{nodes} python -m mpilearn.jobs --stage "$MPILEARN_STAGE" --kind {kind} '
                  '--config "$CONFIG" "$@" || exit 1']
    lines += [
        f"{launch} python -m {ENTRY[kind]} --config \"$CONFIG\" --output \"$OUTPUT\" "
        "--resume auto --no-progress " + "".join(f"--set {q(v)} " for v in sets) + "\"$@\" &",
        "pid=$!",
        "# SLURM signals the batch shell (B:USR1) before the time limit: pass it to every rank",
        "trap 'kill -USR1 $pid 2>/dev/null' USR1 TERM",
        *WAIT_FOR_LAUNCHER,
        'rm -f "$HOSTFILE"',
        "# 75: stopped with its state saved. Only a job that still runs requeues itself (the",
        "# time-limit warning, or a signal sent by hand without cancelling); a cancelled job",
        "# stays cancelled, and SLURM requeues a preempted one (PreemptMode=REQUEUE) itself",
        "state=$( [ $rc -ne 0 ] && scontrol show job -o \"$SLURM_JOB_ID\" 2>/dev/null "
        "| grep -o 'JobState=[A-Z_]*')",
        f'saved={SAVED[kind]}',
        'if [ $rc -ne 0 ] && [ "${state#JobState=}" != RUNNING ]; then',
        '  echo "mpilearn: job $SLURM_JOB_ID was cancelled (${state:-JobState unknown}, exit '
        '$rc): it stays cancelled, not requeued; its state is saved in $saved; sbatch the same '
        'script again to continue"',
        'elif [ $rc -eq 75 ] && [ "${MPILEARN_REQUEUE:-1}" = 1 ]; then',
    ]
    if site["stage_to"]:
        lines.append("  unstage  # before the requeue ends this shell")
    lines += [
        '  echo "mpilearn: stopped with its state saved; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "elif [ $rc -eq 75 ]; then",
        '  echo "mpilearn: stopped with its state saved in $saved; not requeued '
        '(MPILEARN_REQUEUE=$MPILEARN_REQUEUE)"',
        "# a crash: a rank killed (137: SIGKILL, the OOM killer), stuck (124), a traceback (1).",
        "# Requeued a bounded number of times (counted in the run directory, per job); bad",
        "# input (2) and a run its guard stopped (3, 4) would fail alike: never",
        'elif [ $rc -ne 0 ] && [ $rc -ne 2 ] && [ $rc -ne 3 ] && [ $rc -ne 4 ] '
        '&& [ "${MPILEARN_REQUEUE:-1}" = 1 ]; then',
        '  crashes="$OUTPUT/.crashes-$SLURM_JOB_ID"',
        '  n=$(( $(cat "$crashes" 2>/dev/null || echo 0) + 1 ))',
        f'  if [ $n -le {site["max_restarts"]} ]; then',
        '    echo $n > "$crashes"',
    ]
    if site["stage_to"]:
        lines.append("    unstage")
    lines += [
        f'    echo "mpilearn: exit $rc; restart $n of at most {site["max_restarts"]} after a crash: '
        'requeueing job $SLURM_JOB_ID from $saved"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "  else",
        f'    echo "mpilearn: exit $rc; not requeued: {site["max_restarts"]} restart(s) after '
        'a crash already (max_restarts in the site profile)"',
        "  fi",
        "fi",
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"


def examples(folder: str = "jobs") -> dict:
    """name -> script text of the ready scripts (run from the repository root)."""
    site_path = os.path.join(folder, "site-example.yaml")
    out = {}
    for name, (kind, config_path, launcher) in EXAMPLES.items():
        config = _config(kind, config_path)
        site = load_site(site_path, {"launcher": launcher})
        out[name] = render(kind, config_path, config["output"] or f"runs/{kind}", config, site)
    return out


def templates_dir() -> str:
    """The ready jobs files: mpilearn/jobs_data/ in an installed wheel, else the checkout's
    jobs/ (the wheel's copy is made from it at build time)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root
    for folder in (os.path.join(here, "jobs_data"), os.path.join(os.path.dirname(here), "jobs")):
        if os.path.isfile(os.path.join(folder, "site-example.yaml")):
            return folder
    raise UsageError(f"no jobs templates found (looked in {here}/jobs_data and the checkout's "
                     "jobs/): reinstall mpilearn")


def copy_templates(dest: str) -> list:
    """Copy the configs, site profile, sbatch scripts and chain.sh into ``dest``; an existing
    file is never overwritten (refused before anything is copied)."""
    import shutil

    src = templates_dir()
    names = sorted(n for n in os.listdir(src) if n.endswith((".yaml", ".sbatch", ".sh")))
    present = [n for n in names if os.path.exists(os.path.join(dest, n))]
    if present:
        raise UsageError(f"--templates {dest}: {', '.join(present)} already there; choose an "
                         "empty directory (nothing was copied)")
    os.makedirs(dest, exist_ok=True)
    for name in names:
        shutil.copy2(os.path.join(src, name), dest)
    return names


def _config(kind: str, path: str, sets=()) -> dict:
    from ..core.config import hpo_schema, resolve

    if kind == "hpo":
        return resolve(path, sets, schema=hpo_schema(), require_model=False)
    return resolve(path, sets)


def _stage(stage_dir: str, config: dict) -> None:
    """One node's copy of the data files (run once per node by the batch script)."""
    import socket

    from .stage import remove_left_behind, stage
    from ..train.checks import expand_files

    for path in remove_left_behind(stage_dir):
        print(f"mpilearn: removed {path} on {socket.gethostname()}, the stage of a job that "
              "no longer runs", flush=True)
    data = config["data"]
    files, size = stage(expand_files(data["files"]) + expand_files(data["val_files"], "data.val_files"), stage_dir)
    print(f"mpilearn: staged {files} file(s), {size / 2**20:.1f} MiB, to {stage_dir} on "
          f"{socket.gethostname()}", flush=True)


def remove_old_hostfiles(hostfile: str) -> list:
    """Host files beside ``hostfile`` (hosts-<job id>) of jobs that no longer run."""
    import glob

    from . import slurmjob

    removed = []
    for path in glob.glob(os.path.join(os.path.dirname(hostfile) or ".", "hosts-*")):
        job = os.path.basename(path)[len("hosts-"):]
        if path != hostfile and job.isdigit() and slurmjob.running(job) is False:
            os.unlink(path)
            removed.append(path)
    return removed


def _render_kubernetes(args, config: dict, output: str) -> str:
    """The MPIJob, after every check the job would make at start that can be made here."""
    from . import carry, jobcheck, kubernetes

    for flag in ("launcher", "partition", "account"):
        if getattr(args, flag):
            raise UsageError(f"--{flag} is a SLURM setting; with --target kubernetes the site "
                             "profile's kubernetes: section places the job")
    site = load_site(args.site, {})
    source = args.site or "site"
    kube = kubernetes.profile(site["kubernetes"], {
        "workers": args.nodes, "slots_per_worker": args.tasks_per_node,
        "gpus_per_worker": args.gpus_per_node, "image": args.image,
        "deadline": args.time}, source)
    if kube["image"] == kubernetes.SITE["image"] and not args.image:
        sys.stderr.write(f"mpilearn: warning: no image named (kubernetes.image in the site "
                         f"profile, or --image): the job uses {kube['image']}, which the "
                         "cluster's nodes must be able to pull\n")
    for named in kubernetes.gpu_placement_without_gpus(kube):
        sys.stderr.write(f"mpilearn: warning: the job asks for no GPU but its workers' "
                         f"{named} places them on GPU nodes\n")
    jobcheck.check_slots(kube["slots_per_worker"], kube["gpus_per_worker"], config,
                         ("slots_per_worker (--tasks-per-node)",
                          "gpus_per_worker (--gpus-per-node)"))
    path = carry.model_file(config)
    if path and os.path.isabs(path) and carry.on_volume(path, kube):
        sys.stderr.write(f"mpilearn: warning: model {path} is on a pod volume: not checked here\n")
    else:
        jobcheck.check_config(args.kind, config)
    jobcheck.check_pod_paths(args.kind, config, kube, source)
    return kubernetes.render(args.kind, args.config, output, config, kube, args.set)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpilearn.jobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=sorted(ENTRY), default="train")
    p.add_argument("--config", help="the run's config (YAML), checked before rendering")
    p.add_argument("--output", help="run directory (default: the config's, else runs/<kind>)")
    p.add_argument("--site", help="site profile (YAML); keys: " + ", ".join(SITE))
    p.add_argument("--launcher", choices=("srun", "mpirun"))
    p.add_argument("--target", choices=("slurm", "kubernetes"), default="slurm",
                   help="a SLURM batch script, or a Kubeflow MPIJob (the site's kubernetes: "
                        "section; --nodes, --tasks-per-node, --gpus-per-node, --image and --time "
                        "(runPolicy.activeDeadlineSeconds) override it)")
    p.add_argument("--image", help="with --target kubernetes: the container image")
    for key in ("nodes", "tasks_per_node", "gpus_per_node"):
        p.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    for key in ("time", "partition", "account"):
        p.add_argument("--" + key, dest=key)
    p.add_argument("--examples", metavar="DIR",
                   help="(re)write the ready scripts in DIR (jobs/) from DIR/site-example.yaml")
    p.add_argument("--templates", metavar="DIR",
                   help="copy the ready jobs files (configs, site profile, sbatch scripts, "
                        "chain.sh) into DIR, e.g. jobs")
    job = p.add_argument_group("at job start (the batch script calls these; other mpilearn "
                               "flags after them are ignored)")
    job.add_argument("--plan", action="store_true",
                     help="check the run's layout against the SLURM allocation, write "
                          "--hostfile, print the number of ranks to launch")
    job.add_argument("--hostfile", help="with --plan: the host file to write")
    job.add_argument("--stage", metavar="DIR", help="copy the config's data files under DIR")
    job.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="config overrides, as the run gets them")
    args, unknown = p.parse_known_args(argv)
    if unknown and not (args.plan or args.stage):
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.plan or args.stage:
            if not args.config:
                raise UsageError("--config is required")
            # a training run's ranks are the allocation's: its config matters only to staging
            config = (_config(args.kind, args.config, args.set)
                      if args.stage or args.kind == "hpo" else {})
            if args.stage:
                _stage(args.stage, config)
                return 0
            from .allocation import plan

            if args.hostfile:
                for path in remove_old_hostfiles(args.hostfile):
                    sys.stderr.write(f"mpilearn: removed {path}, the host file of a job that "
                                     "no longer runs\n")
            ntasks, note = plan(args.kind, config, args.config, args.launcher or "srun",
                                args.hostfile)
            if note:
                sys.stderr.write(note + "\n")
            print(ntasks)
            return 0
        if args.templates:
            names = copy_templates(args.templates)
            print(f"mpilearn: {len(names)} file(s) from {templates_dir()} -> {args.templates}: "
                  f"{' '.join(names)}")
            return 0
        if args.examples:
            for name, text in examples(args.examples).items():
                with open(os.path.join(args.examples, name), "w") as f:
                    f.write(text)
            return 0
        if not args.config:
            raise UsageError("--config is required")
        config = _config(args.kind, args.config, args.set)
        output = args.output or config["output"] or f"runs/{args.kind}"
        if args.target == "kubernetes":
            sys.stdout.write(_render_kubernetes(args, config, output))
            return 0
        site = load_site(args.site, {k: getattr(args, k) for k in (
            "launcher", "nodes", "tasks_per_node", "gpus_per_node", "time", "partition", "account")})
        from . import jobcheck

        jobcheck.check_slots(site["tasks_per_node"], site["gpus_per_node"], config,
                             ("tasks_per_node", "gpus_per_node"))
        jobcheck.check_config(args.kind, config)
        for missing in jobcheck.missing_here(args.kind, config):
            sys.stderr.write(f"mpilearn: warning: {missing} matches no file here; the job reads "
                             "it relative to the directory sbatch runs in\n")
        sys.stdout.write(render(args.kind, args.config, output, config, site, args.set or ()))
    except UsageError as err:
        sys.stderr.write(f"mpilearn: error: {err}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
