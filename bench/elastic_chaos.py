"""The chaos run of ``bench/elastic.py --chaos``: 8 ranks under ``mpirun --with-ft ulfm`` with
``train.elastic.min_ranks`` 4; from outside, a real ``kill -9`` of a random live rank (rank 0
too) every few seconds, up to ``--chaos-kills`` times (seeded). The run must finish, and its
final weights (float64, with the model's count of every event it trained) must equal the replay:
plain ``mpirun`` runs stopped (``MPILEARN_TEST_STOP``) at each recorded step and resumed at the
recorded size. Every event must be trained once per epoch, but for the tail of an epoch that
does not fill the last global batch (computed from the recorded positions)."""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = os.path.join(REPO, "tests", "models", "elastic_mlp.py")
MARK = "MPILEARN_CHAOS_MARK"
STARTED = "mpilearn: elastic:"  # rank 0's line once the first snapshot exists: kills begin


def train_cmd(np_, out, data, args, ulfm, resume=False, env=()):
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe"]
    if ulfm:
        cmd[1:1] = ["--with-ft", "ulfm"]
    for k in env:
        cmd += ["-x", k]
    cmd += [sys.executable, "-m", "mpilearn.train", "--no-progress", "--output", out,
            "--set", f"model={MODEL}", "--set", f"data.files=[{data}]",
            "--set", "data.val_fraction=0.0625", "--set", f"train.epochs={args.chaos_epochs}",
            "--set", f"train.batch_size={args.chaos_batch}", "--set", "train.deterministic=true",
            "--set", f"hparams.events={args.chaos_events}",
            "--set", f"hparams.sleep={args.chaos_sleep}"]
    if ulfm:
        cmd += ["--set", f"train.elastic.min_ranks={args.chaos_min}"]
    return cmd + (["--resume"] if resume else [])


def rank_pids(marker: str) -> dict:
    """World rank -> pid of the ranks whose environment holds ``marker``."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in env:
            for item in env:
                if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                    found[int(item.split(b"=")[1])] = int(pid)
    return found


def elastic_run(args, data, out, env):
    """The ULFM run with the external kills; returns (process, kills, output, seconds)."""
    rng = random.Random(args.chaos_seed)
    marker = f"{MARK}={out}"
    cmd = train_cmd(args.chaos_ranks, out, data, args, True, env=[MARK])
    began = time.monotonic()
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           cwd=REPO, env={**env, MARK: out})
    lines, started = [], threading.Event()

    def read():
        for line in job.stdout:
            lines.append(line)
            if line.startswith(STARTED):
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    kills = []
    while not started.wait(0.5) and job.poll() is None:  # a run that ends in start-up too
        pass
    if started.is_set():
        pids = rank_pids(marker)  # every rank is past its start-up once rank 0 printed
        live = sorted(pids)
        for _ in range(args.chaos_kills):
            time.sleep(rng.uniform(*args.chaos_every))
            if job.poll() is not None or len(live) <= args.chaos_min:
                break
            victim = rng.choice(live)
            os.kill(pids[victim], signal.SIGKILL)
            live.remove(victim)
            kills.append({"rank": victim, "at_s": round(time.monotonic() - began, 2)})
    try:
        job.wait(args.timeout)
    except subprocess.TimeoutExpired:
        for pid in rank_pids(marker).values():  # where they wait, then end them
            os.kill(pid, signal.SIGUSR1)
        time.sleep(2)
        job.kill()
        job.wait()
    reader.join(10)
    return job, kills, "".join(lines), time.monotonic() - began


def replay(args, data, out, changes, env):
    """Stop at each recorded step, resume at the recorded size, to the end; returns the
    segments run as (ranks, steps or None for 'to the end')."""
    size, done, segments = args.chaos_ranks, 0, []
    for step, ranks in changes:
        if step > done:  # two losses at one step change only the size
            stop = {"MPILEARN_TEST_STOP": str(step - done)}
            proc = subprocess.run(train_cmd(size, out, data, args, False, resume=done > 0,
                                            env=stop), capture_output=True, text=True,
                                  cwd=REPO, env={**env, **stop}, timeout=args.timeout)
            if proc.returncode != 75:
                raise SystemExit(f"replay at {size} ranks to step {step} ended "
                                 f"{proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
            segments.append((size, step - done))
            done = step
        size = ranks
    proc = subprocess.run(train_cmd(size, out, data, args, False, resume=done > 0),
                          capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"replay's last run at {size} ranks ended {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    segments.append((size, None))
    return segments


def final_model(out):
    from mpilearn.train import checkpoint as ckpt

    return ckpt.load(ckpt.latest(os.path.join(out, "checkpoints")))["task"]["models"]["model"]


def expected_seen(args, n_events, records):
    """Each event's expected count: per epoch, the epoch's order up to its last position (the
    position of its last recorded change plus the whole global batches left from there)."""
    from mpilearn.data.hdf5 import epoch_order, split_events

    train_events = np.sort(split_events(n_events, 0.0625, 0)[0])
    n = len(train_events)
    seen = np.zeros(args.chaos_events)
    tails = []
    for epoch in range(args.chaos_epochs):
        position, g = 0, args.chaos_batch * args.chaos_ranks
        for r in records:
            if "membership" in r and r["epoch"] == epoch + 1:
                position, g = r["position"], r["global_batch"]
        end = position + (n - position) // g * g
        tails.append(n - end)
        order = train_events[epoch_order(n, epoch, 0, True)]
        seen[order[:end]] += 1
    return seen, tails


def chaos(args, data, tmp, env) -> dict:
    out = os.path.join(tmp, "chaos")
    job, kills, output, seconds = elastic_run(args, data, out, env)
    row = {"ranks": args.chaos_ranks, "min_ranks": args.chaos_min, "seed": args.chaos_seed,
           "kills": kills, "exit": job.returncode, "wall_s": round(seconds, 1)}
    if job.returncode != 0:
        row["output_tail"] = output[-4000:]
        return row
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    changes = [(r["step"], r["membership"]["ranks"]) for r in records if "membership" in r]
    row["changes"] = [{"step": r["step"], "epoch": r["epoch"], "position": r["position"],
                       "lost": r["membership"]["lost_ranks"], "ranks": r["membership"]["ranks"],
                       "global_batch": r["global_batch"]} for r in records if "membership" in r]
    row["steps"] = [r["step"] for r in records if "time" in r][-1]
    began = time.monotonic()
    row["replay"] = replay(args, data, os.path.join(tmp, "replay"), changes, env)
    row["replay_s"] = round(time.monotonic() - began, 1)
    got, want = final_model(out), final_model(os.path.join(tmp, "replay"))
    diffs = {k: float((got[k] - want[k]).abs().max()) for k in want}
    row["equal"] = all(d == 0 for d in diffs.values())
    row["max_diff"] = max(diffs.values())
    import h5py

    with h5py.File(data) as f:
        n_events = len(f[next(iter(f.keys()))])
    seen, tails = expected_seen(args, n_events, records)
    row["seen_exact"] = bool(np.array_equal(got["seen"].numpy(), seen))
    row["epoch_tails"] = tails
    return row


def markdown(row) -> list:
    head = (f"## Elastic training: a chaos run ({row['ranks']} ranks, min_ranks "
            f"{row['min_ranks']}, a random rank killed -9 from outside every few seconds, "
            f"seed {row['seed']})")
    md = [head, "", "| kills (rank @ s) | sizes (at step) | steps | exit | equal to replay "
          "(max diff) | every event once/epoch | wall s | replay s |",
          "|---|---|---|---|---|---|---|---|"]
    kills = ", ".join(f"{k['rank']} @ {k['at_s']}" for k in row["kills"])
    if row["exit"] != 0:
        return md + [f"| {kills} | | | {row['exit']} | | | {row['wall_s']} | |"]
    sizes = " → ".join([str(row["ranks"])] + [f"{c['ranks']} ({c['step']})"
                                               for c in row["changes"]])
    md.append(f"| {kills} | {sizes} | {row['steps']} | 0 | {row['equal']} ({row['max_diff']:.3g}) "
              f"| {row['seen_exact']} (tails {row['epoch_tails']}) | {row['wall_s']} | "
              f"{row['replay_s']} |")
    return md
