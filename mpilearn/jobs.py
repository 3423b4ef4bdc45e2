"""python -m mpilearn.jobs: render a SLURM batch script from a run config and a site profile.

    python -m mpilearn.jobs --kind train --config jobs/train-3dgan.yaml --site site.yaml \\
        --nodes 4 --time 12:00:00 > train.sbatch
    sbatch train.sbatch

The script activates the site's modules and virtual environment, launches with ``srun`` or
``mpirun``, forwards the early-warning signal (``--signal=B:USR1@grace``) to every rank, and
requeues itself when mpilearn exits 75 (stopped with its state saved); the next run picks up
with ``--resume auto``. The scripts in ``jobs/`` are this command's output for
``jobs/site-example.yaml``.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import shlex
import sys

from .errors import UsageError

# the site profile: key -> default (the default's type is the type the key accepts)
SITE = {
    "partition": "",          # empty: the cluster's default partition
    "account": "",
    "qos": "",
    "modules": [],            # module load ... (in order)
    "venv": "",               # virtual environment to activate; default $SLURM_SUBMIT_DIR/.venv
    "launcher": "srun",       # srun | mpirun
    "srun_mpi": "pmix",       # srun --mpi=... (pmix, pmi2; see srun --mpi=list)
    "mpirun_args": "",        # extra mpirun flags, e.g. "--mca btl ^openib"
    "nodes": 1,
    "tasks_per_node": 2,      # CPU runs; with GPUs, one task per GPU
    "gpus_per_node": 0,
    "cpus_per_task": 0,       # 0: leave it to the cluster
    "time": "01:00:00",
    "signal_grace": 300,      # seconds before the time limit at which mpilearn checkpoints
    "stage_to": "",           # node-local directory to copy the data files to (e.g. /tmp)
    "sbatch": [],             # extra #SBATCH lines, e.g. ["--constraint=a100"]
}

ENTRY = {"train": "mpilearn.train", "hpo": "mpilearn.optimize"}

# the ready scripts in jobs/: file -> (kind, config, launcher), rendered for site-example.yaml
EXAMPLES = {
    "train.sbatch": ("train", "jobs/train-3dgan.yaml", "srun"),
    "train-mpirun.sbatch": ("train", "jobs/train-3dgan.yaml", "mpirun"),
    "hpo.sbatch": ("hpo", "jobs/hpo-mlp.yaml", "srun"),
    "hpo-mpirun.sbatch": ("hpo", "jobs/hpo-mlp.yaml", "mpirun"),
}


def load_site(path: str | None, overrides: dict) -> dict:
    from .config import _check, load_file

    site = copy.deepcopy(SITE)
    for layer, source in ((load_file(path) if path else {}, path or "site"),
                          ({k: v for k, v in overrides.items() if v is not None}, "command line")):
        _check(layer, SITE, "", source)
        site.update(layer)
    if site["launcher"] not in ("srun", "mpirun"):
        raise UsageError(f"site: 'launcher' is {site['launcher']!r}; choose srun or mpirun")
    for key in ("nodes", "tasks_per_node"):
        if site[key] < 1:
            raise UsageError(f"site: '{key}' must be at least 1, got {site[key]}")
    return site


def sweep_tasks(config: dict) -> int:
    """Ranks a sweep needs: 1 coordinator + blocks x block width."""
    from .hpo.layout import block_width

    s = config["search"]
    return 1 + s["blocks"] * block_width(s["folds"], s["ranks_per_fold"], s["fold_mode"])


def layout(kind: str, config: dict, site: dict) -> dict:
    """Nodes, tasks and the per-node task counts the launch line uses."""
    nodes, per_node, gpus = site["nodes"], site["tasks_per_node"], site["gpus_per_node"]
    if gpus:
        per_node = gpus  # one rank per GPU
    if kind == "train":
        return {"ntasks": nodes * per_node, "per_node": per_node, "hosts": None}
    workers = sweep_tasks(config) - 1
    if gpus and workers != nodes * gpus:
        raise UsageError(
            f"the sweep has {workers} training ranks (search.blocks x folds x ranks_per_fold) but "
            f"{nodes} node(s) x {gpus} GPU(s) = {nodes * gpus}: make them equal (the coordinator "
            "takes no GPU and shares the first node)")
    per_node = math.ceil(workers / nodes)
    # the coordinator is one extra task on the first node; the rest fill nodes in order
    return {"ntasks": workers + 1, "per_node": per_node + 1,
            "hosts": [per_node + 1] + [per_node] * (nodes - 1)}


def render(kind: str, config_path: str, output: str, config: dict, site: dict) -> str:
    lay = layout(kind, config, site)
    q = shlex.quote
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=mpilearn-{kind}",
             f"#SBATCH --nodes={site['nodes']}",
             f"#SBATCH --ntasks-per-node={lay['per_node']}"]
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
    lines += [
        f"# rendered by: python -m mpilearn.jobs --kind {kind} (launcher: {site['launcher']})",
        "# usage: sbatch [sbatch flags] THIS_SCRIPT [CONFIG [OUTPUT [mpilearn flags...]]]",
        "# env: MPILEARN_VENV, MPILEARN_MODULES, MPILEARN_REQUEUE=0 (chains: jobs/chain.sh)",
        "set -uo pipefail",
        f'CONFIG=${{1:-{q(config_path)}}}',
        f'OUTPUT=${{2:-{q(output)}}}',
        "shift $(( $# < 2 ? $# : 2 ))",
        f'MODULES=${{MPILEARN_MODULES-{q(modules)}}}',
        f'VENV=${{MPILEARN_VENV:-{venv}}}',
        'if [ -n "$MODULES" ]; then module purge && module load $MODULES; fi',
        'source "$VENV/bin/activate"',
        "# threads per rank: --cpus-per-task when given, else mpilearn's cores / ranks per node",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK; '
        'else unset OMP_NUM_THREADS; fi',
        'echo "mpilearn: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on '
        '${SLURM_JOB_NODELIST}: $CONFIG -> $OUTPUT"',
        'mkdir -p "$OUTPUT"',
    ]
    extra = []
    if site["stage_to"]:
        # one copy per node, in parallel; the run then reads the node-local copy
        stage = f"{site['stage_to']}/mpilearn-$SLURM_JOB_ID"
        lines += [f'STAGE="{stage}"',
                  'FILES=$(python -m mpilearn.jobs --list-files "$CONFIG")',
                  'srun --ntasks-per-node=1 --ntasks=$SLURM_JOB_NUM_NODES bash -c '
                  '"mkdir -p $STAGE && cp $FILES $STAGE/"',
                  'STAGED=$(for f in $FILES; do printf "%s," "$STAGE/$(basename $f)"; done)']
        extra.append('--set "data.files=[${STAGED%,}]"')
    if lay["hosts"]:
        lines.insert(lines.index("set -uo pipefail"),
                     f"# {lay['ntasks']} ranks = 1 coordinator + {lay['ntasks'] - 1} training ranks, "
                     f"from the search section of {config_path}; render anew for another layout")
        # first node: the coordinator + its share of workers, written as a host list
        counts = " ".join(str(c) for c in lay["hosts"])
        line = ('echo "${HOSTS[$i]} slots=${COUNTS[$i]}"' if site["launcher"] == "mpirun" else
                'for _ in $(seq ${COUNTS[$i]}); do echo "${HOSTS[$i]}"; done')
        lines += ['HOSTS=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
                  f"COUNTS=({counts})",
                  'HOSTFILE="$OUTPUT/hosts-$SLURM_JOB_ID"',
                  f'for i in "${{!COUNTS[@]}}"; do {line}; done > "$HOSTFILE"']
    if site["launcher"] == "srun":
        launch = f"srun --mpi={site['srun_mpi']} --kill-on-bad-exit=1 --ntasks={lay['ntasks']}"
        if lay["hosts"]:
            lines.append('export SLURM_HOSTFILE="$HOSTFILE"')
            launch += " --distribution=arbitrary"
    else:
        launch = f"mpirun -np {lay['ntasks']}"
        launch += " --hostfile \"$HOSTFILE\"" if lay["hosts"] else f" --map-by ppr:{lay['per_node']}:node"
        launch += " --bind-to none" + (f" {site['mpirun_args']}" if site["mpirun_args"] else "")
    lines += [
        f"{launch} python -m {ENTRY[kind]} --config \"$CONFIG\" --output \"$OUTPUT\" "
        f"--resume auto --no-progress {' '.join(extra)} \"$@\" &".replace("  ", " "),
        "pid=$!",
        "# SLURM signals the batch shell (B:USR1) before the time limit: pass it to every rank",
        "trap 'kill -USR1 $pid 2>/dev/null' USR1 TERM",
        'wait "$pid"; rc=$?',
        'while [ $rc -gt 128 ] && kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done',
        'if [ $rc -eq 75 ] && [ "${MPILEARN_REQUEUE:-1}" = 1 ]; then',
        '  echo "mpilearn: stopped with its state saved; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
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


def _config(kind: str, path: str) -> dict:
    from .config import hpo_schema, resolve

    if kind == "hpo":
        return resolve(path, schema=hpo_schema(), require_model=False)
    return resolve(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpilearn.jobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=sorted(ENTRY), default="train")
    p.add_argument("--config", help="the run's config (YAML), checked before rendering")
    p.add_argument("--output", help="run directory (default: the config's, else runs/<kind>)")
    p.add_argument("--site", help="site profile (YAML); keys: " + ", ".join(SITE))
    p.add_argument("--launcher", choices=("srun", "mpirun"))
    for key in ("nodes", "tasks_per_node", "gpus_per_node"):
        p.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    for key in ("time", "partition", "account"):
        p.add_argument("--" + key, dest=key)
    p.add_argument("--examples", metavar="DIR",
                   help="(re)write the ready scripts in DIR (jobs/) from DIR/site-example.yaml")
    p.add_argument("--list-files", metavar="CONFIG",
                   help="print the data files a config reads (used by the staging step)")
    args = p.parse_args(argv)
    try:
        if args.list_files:
            from .train.checks import expand_files

            print(" ".join(expand_files(_config(args.kind, args.list_files)["data"]["files"])))
            return 0
        if args.examples:
            for name, text in examples(args.examples).items():
                with open(os.path.join(args.examples, name), "w") as f:
                    f.write(text)
            return 0
        if not args.config:
            raise UsageError("--config is required")
        config = _config(args.kind, args.config)
        site = load_site(args.site, {k: getattr(args, k) for k in (
            "launcher", "nodes", "tasks_per_node", "gpus_per_node", "time", "partition", "account")})
        output = args.output or config["output"] or f"runs/{args.kind}"
        sys.stdout.write(render(args.kind, args.config, output, config, site))
    except UsageError as err:
        sys.stderr.write(f"mpilearn: error: {err}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
