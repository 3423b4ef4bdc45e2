"""The original code as a peer, side by side (issue 37 item 2): recardoso/Accelarated3DGAN
(TF2 custom loop, four gradient tapes under tf.distribute) vs mpilearn's Keras twin and its
PyTorch 3DGAN, on the same simulated showers and global batch, np / workers = 1 and 2.

    python bench/tf_peer.py --peer-dir /tmp/peer-3dgan [--peer-python .venv-peer/bin/python]
                            [--quick] [--events 1024] [--batch 64] [--epochs 2] [--seed 0]
                            [--out bench/results/tf_peer]

PEER_DIR is a git checkout of https://github.com/recardoso/Accelarated3DGAN (MIT); nothing of
it is copied here. Its environment (PEER_PYTHON) is TensorFlow 2.x with Keras 2 (tf-keras,
selected by TF_USE_LEGACY_KERAS=1, TensorFlow's documented way to run Keras 2 code on
TF >= 2.16); ``make`` does not build it: see docs/benchmarks/training.md for the two pip lines.

Per case, 1 and 2 processes on this host:
  original   gan_main.py, run as its code sets itself up for several workers: ``--multi_node
             True --workers localhost:P0 [localhost:P1] --index I`` (it writes TF_CONFIG from
             them and builds MultiWorkerMirroredStrategy), ``--batchsize`` = global batch /
             workers (its per-replica batch), ``--nbepochs``, ``--datapath``, ``--outpath``;
             CUDA_VISIBLE_DEVICES= (CPU), TF_NUM_INTRAOP/INTEROP_THREADS = cores / workers
             (what mpilearn gives each rank). Its events/s: global batch x batches / the sum of
             its own "Time taken by batch" lines of the last epoch (the first epoch holds the
             tf.function tracing; with one epoch, all batches but the first).
  mpilearn   ``mpirun -np N python -m mpilearn.train`` with models/gan3d_keras.py (Keras 3 on
             TensorFlow, four DistributedGradientTapes) and models/gan3d.py (PyTorch), full
             angle model, RMSprop lr 1e-3 unscaled (as the original), the same epochs and
             steps; events/s of the last epoch (metrics.jsonl).
Physics after the same number of events: every run's last generator makes one shower per
held-out MC event (the original's through its own generator_model and saved weights,
bench/tf_peer_generate.py; mpilearn's through ``python -m mpilearn.generate --conditions``),
scored by ``python -m mpilearn.validate --generated``.

The original needs exactly one change to run at any size but its own: gan_main.py hard-codes
its epoch as 124 987 events and its test pass as 12 340 (``# needs to change so it is not hard
coded``); both are set to this data's counts in a temporary copy (PATCHES). Nothing else of it
is changed.
"""
import argparse
import difflib
import glob
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_URL = "https://github.com/recardoso/Accelarated3DGAN"
PEER_FILES = ("gan_main.py", "gan_training.py", "gan_models.py", "gan_dataset.py")
# (file, original line, replacement): the epoch and test-pass sizes gan_main.py hard-codes
PATCHES = [("gan_main.py", "steps_per_epoch =int( 124987 // (batch_size))",
            "steps_per_epoch =int( {train} // (batch_size))"),
           ("gan_main.py", "test_steps_per_epoch =int( 12340 // (batch_size))",
            "test_steps_per_epoch =int( {test} // (batch_size))")]
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "TQDM_DISABLE": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
MPILEARN = [("mpilearn Keras 3 on TensorFlow (models/gan3d_keras.py)", "gan3d_keras.py",
             {"KERAS_BACKEND": "tensorflow"}),
            ("mpilearn PyTorch (models/gan3d.py)", "gan3d.py", {})]
ORIGINAL = "original (Accelarated3DGAN, MultiWorkerMirroredStrategy)"
PHYSICS = ("score", "score_ratio", "reference_metric_filled", "reference_metric_filled_ratio",
           "sampling_fraction_mre", "sampling_fraction_mre_ratio", "events")


def peer_commit(peer_dir):
    """The checkout's commit, and a refusal if its four files differ from it."""
    def git(*a):
        return subprocess.run(["git", "-C", peer_dir, *a], capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode:
        sys.exit(f"--peer-dir {peer_dir}: not a git checkout ({head.stderr.strip()}); "
                 f"clone {PEER_URL}")
    dirty = git("status", "--porcelain", "--", *PEER_FILES).stdout.strip()
    if dirty:
        sys.exit(f"--peer-dir {peer_dir} has local changes ({dirty}): the bench runs the "
                 "original unmodified and applies its own patch to a temporary copy")
    return head.stdout.strip()


def patched_copy(peer_dir, dest, train, test):
    """PEER_DIR's four files in DEST, with PATCHES applied; returns the unified diff."""
    os.makedirs(dest, exist_ok=True)
    for name in PEER_FILES:
        shutil.copy(os.path.join(peer_dir, name), dest)
    diff = []
    for name, old, new in PATCHES:
        path = os.path.join(dest, name)
        text = open(path).read()
        if text.count(old) != 1:
            sys.exit(f"{name}: expected the line {old!r} once; the peer changed, adapt PATCHES")
        patched = text.replace(old, new.format(train=train, test=test))
        diff += difflib.unified_diff(text.splitlines(True), patched.splitlines(True),
                                     f"a/{name}", f"b/{name}", n=0)
        open(path, "w").write(patched)
    return "".join(diff)


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_all(procs, timeout):
    """Waits for every process; on a failure or the timeout, ends the others (their groups)."""
    deadline = time.time() + timeout
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed or time.time() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                p.wait()
            return "timed out" if not failed else "a worker failed"
        time.sleep(1)
    return None


def run_original(a, workers, data, work):
    """gan_main.py on `workers` local processes; the row, with worker 0's generator weights."""
    code = os.path.join(work, f"peer-code-w{workers}")
    diff = patched_copy(a.peer_dir, code, data["train_events"], data["peer_test_events"])
    ports = free_ports(workers)
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    env = {**ENV, "TF_USE_LEGACY_KERAS": "1", "CUDA_VISIBLE_DEVICES": "",
           "TF_NUM_INTRAOP_THREADS": threads, "TF_NUM_INTEROP_THREADS": threads}
    env.pop("PYTHONPATH", None)  # the peer's own environment, not this repository
    procs, logs, commands = [], [], []
    t0 = time.time()
    for i in range(workers):
        out = os.path.join(work, f"peer-w{workers}-{i}") + "/"
        for sub in ("weights/3dgan_weights_peer", "results"):  # it writes there, creates neither
            os.makedirs(out + sub, exist_ok=True)
        cmd = [a.peer_python, "gan_main.py", "--multi_node", "True",
               "--workers", *[f"localhost:{p}" for p in ports], "--index", str(i),
               "--datapath", data["glob"], "--outpath", out, "--nbepochs", str(a.epochs),
               "--batchsize", str(a.batch // workers), "--name", "peer"]
        commands.append(" ".join(cmd))
        logs.append(out + "log.txt")
        procs.append(subprocess.Popen(cmd, cwd=code, env=env, stdout=open(logs[-1], "w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
    problem = _wait_all(procs, a.timeout)
    wall = time.time() - t0
    text = open(logs[0]).read()
    row = {"case": ORIGINAL, "np": workers, "global_batch": a.batch, "wall_s": wall,
           "commands": commands, "log": logs[0], "patch": diff,
           "env": {k: env[k] for k in ("TF_USE_LEGACY_KERAS", "CUDA_VISIBLE_DEVICES",
                                       "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")}}
    if problem or any(p.returncode for p in procs):
        tails = [open(log).read()[-3000:] for log in logs]
        row["error"] = f"{problem or 'exit ' + str([p.returncode for p in procs])}: " + "\n---\n".join(tails)
        return row, None
    epochs = [[]]
    for line in text.splitlines():
        if re.match(r"Epoch \d+ of \d+", line) and epochs[-1]:
            epochs.append([])
        m = re.match(r"Time taken by batch (\d+)\s+was ([0-9.e+-]+) seconds", line)
        if m:
            epochs[-1].append(float(m.group(2)))
    measured = epochs[-1] if len(epochs) > 1 else epochs[-1][1:]
    row.update({"steps": len(epochs[0]), "epochs": len(epochs), "measured_batches": len(measured),
                "events_trained": a.batch * sum(len(e) for e in epochs),
                "events_per_s": a.batch * len(measured) / sum(measured),
                "batch_seconds": epochs})
    weights = sorted(glob.glob(os.path.join(work, f"peer-w{workers}-0", "weights", "3dgan_weights_peer",
                                            "params_generator_epoch_*.hdf5")))
    return row, weights[-1] if weights else None


def run_mpilearn(a, name, model, env, np_, data, work):
    out = os.path.join(work, f"mpilearn-{model[:-3]}-np{np_}-seed{a.seed}")
    steps = data["train_events"] // a.batch
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", sys.executable, "-m", "mpilearn.train",
           "--no-progress", "--output", out, "--set", f"model={REPO}/models/{model}",
           "--set", f"data.files=[{data['train_dir']}/*.h5]", "--set", "hparams.preset=full",
           "--set", f"train.epochs={a.epochs}", "--set", f"train.batch_size={a.batch // np_}",
           "--set", "train.backend=mpi", "--set", "train.lr_scaling=none",
           "--set", "data.val_fraction=0.0", "--set", f"train.max_steps_per_epoch={steps}",
           "--set", f"train.seed={a.seed}"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **env}, cwd=REPO,
                          timeout=a.timeout)
    row = {"case": name, "np": np_, "global_batch": a.batch, "wall_s": time.time() - t0,
           "seed": a.seed, "commands": [" ".join(cmd)]}
    if proc.returncode:
        row["error"] = proc.stderr[-3000:]
        return row, None
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    epochs = [r for r in records if r.get("samples_per_s")]
    last = epochs[-1]
    row.update({"steps": last["step"] // len(epochs), "epochs": len(epochs),
                "events_trained": last["step"] * a.batch, "events_per_s": last["samples_per_s"]})
    return row, out


def generate(a, row, source, data, work, tag):
    """One shower per held-out MC event from the run's last generator; the file, or None."""
    out = os.path.join(work, f"generated-{tag}.h5")
    if row["case"] == ORIGINAL:
        env = {**ENV, "TF_USE_LEGACY_KERAS": "1", "CUDA_VISIBLE_DEVICES": ""}
        env.pop("PYTHONPATH", None)
        cmd = [a.peer_python, os.path.join(REPO, "bench", "tf_peer_generate.py"), a.peer_dir, source,
               data["mc"], out]
    else:
        env = {**ENV, **next(e for n, _, e in MPILEARN if n == row["case"])}
        cmd = [sys.executable, "-m", "mpilearn.generate", source, "--conditions", data["mc"],
               "--output", out, "--extrapolate", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    row["generate_command"] = " ".join(cmd)
    if proc.returncode:
        row["physics_error"] = "generation: " + proc.stderr[-3000:]
        return None
    return out


def empty_fraction(showers):
    """Generated showers with a cell sum <= 10 (GeV x 50): the preprocessing's filter drops them,
    validate scores only the rest (and none at all when every shower is empty)."""
    import h5py
    import numpy as np

    with h5py.File(showers, "r") as h:
        ecal = h["ECAL"]
        sums = np.concatenate([ecal[i:i + 256].reshape(-1, 51 * 51 * 25).sum(1)
                               for i in range(0, len(ecal), 256)])
    return float(np.mean(sums <= 10.0))


def validate(row, showers, data, work):
    out = showers[:-3] + "-validation"
    row["empty_showers"] = empty_fraction(showers)
    cmd = [sys.executable, "-m", "mpilearn.validate", "--generated", showers, "--mc", data["mc"],
           "--output", out, "--json", out + ".json", "--no-plots",
           "--voxel-events", "0"]  # the voxel classifier: minutes per row on a CPU
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO)
    row["validate_command"] = " ".join(cmd)
    if proc.returncode:
        row["physics_error"] = "validation: " + proc.stderr[-3000:]
        return
    result = json.load(open(out + ".json"))
    row["physics"] = {k: result.get(k) for k in PHYSICS}


def make_data(a, work):
    """Train showers (the mpilearn runs' HDF5, the original's nine train shards) and held-out
    MC (the validation's reference; its first events are the original's test shard)."""
    from mpilearn.calo.simulate import simulate

    from tf_peer_records import write_shards

    train_dir, mc_dir = os.path.join(work, "train"), os.path.join(work, "mc")
    train = simulate(train_dir, a.events, "angle", (100, 200), 1, 5000, progress=False)
    mc = simulate(mc_dir, a.mc_events, "angle", (100, 200), 2, a.mc_events, progress=False)[0]
    peer_test = min(a.mc_events, max(a.batch, (a.events // 9) // a.batch * a.batch))
    rec = write_shards(train, [mc], os.path.join(work, "tfrecords"), test_events=peer_test)
    return {"train_dir": train_dir, "mc": mc, "glob": rec["glob"], "train_events": rec["train_events"],
            "peer_test_events": rec["test_events"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-dir", required=True, help=f"a git checkout of {PEER_URL}")
    p.add_argument("--peer-python", default=os.path.join(REPO, ".venv-peer", "bin", "python"),
                   help="python of the peer's environment (TensorFlow + tf-keras)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: 8 train events, batch 4")
    p.add_argument("--events", type=int, default=1024, help="train events (a multiple of --batch)")
    p.add_argument("--mc-events", type=int, default=512, help="held-out MC events for validation")
    p.add_argument("--batch", type=int, default=64, help="global batch (the original's default)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--np", default="1,2")
    p.add_argument("--cases", default="original,keras,torch")
    p.add_argument("--seed", type=int, default=0,
                   help="mpilearn's train.seed (initial weights, noise); the original seeds nothing")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per run")
    p.add_argument("--keep", action="store_true", help="keep the work folder (printed)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.quick:
        a.events, a.mc_events, a.batch = 8, 64, 4
    a.peer_dir = os.path.abspath(a.peer_dir)
    a.out = a.out or os.path.join(REPO, "bench", "results", "tf_peer_quick" if a.quick else "tf_peer")
    if a.events % a.batch or a.batch % 2:
        sys.exit("--events must be a multiple of --batch, and --batch even (halved at np=2)")
    commit = peer_commit(a.peer_dir)
    versions = subprocess.run([a.peer_python, "-c", "import tensorflow as tf, tf_keras; "
                               "print(tf.__version__, tf_keras.__version__)"],
                              capture_output=True, text=True, env={**ENV, "TF_USE_LEGACY_KERAS": "1"})
    if versions.returncode:
        sys.exit(f"--peer-python {a.peer_python}: needs tensorflow and tf-keras:\n{versions.stderr[-2000:]}")
    tf_version, tf_keras_version = versions.stdout.split()[-2:]
    load_at_start = os.getloadavg()
    work = tempfile.mkdtemp(prefix="mpilearn-tfpeer-")
    data = make_data(a, work)
    print(f"data: {data['train_events']} train events, {a.mc_events} MC, original's test shard "
          f"{data['peer_test_events']}; work folder {work}", flush=True)
    nps = [int(n) for n in a.np.split(",")]
    cases = a.cases.split(",")
    rows = []
    for np_ in nps:
        todo = ([("original", None, None, None)] if "original" in cases else []) + \
               [(k, *c) for k, c in zip(("keras", "torch"), MPILEARN) if k in cases]
        for key, name, model, env in todo:
            if key == "original":
                row, source = run_original(a, np_, data, work)
            else:
                row, source = run_mpilearn(a, name, model, env, np_, data, work)
            if source:
                showers = generate(a, row, source, data, work, f"{key}-np{np_}")
                if showers:
                    validate(row, showers, data, work)
            rows.append(row)
            print(f"{row['case']:60s} np={np_} "
                  + (f"{row['events_per_s']:.3f} events/s" if "events_per_s" in row else "")
                  + (f" score {row['physics']['score']}" if "physics" in row else "")
                  + (f" ERROR {row['error'][-300:]}" if "error" in row else "")
                  + (f" PHYSICS ERROR {row['physics_error'][-300:]}" if "physics_error" in row else ""),
                  flush=True)
    meta = {"peer": PEER_URL, "peer_commit": commit, "peer_tensorflow": tf_version,
            "peer_tf_keras": tf_keras_version, "quick": a.quick, "events": a.events,
            "mc_events": a.mc_events, "batch": a.batch, "epochs": a.epochs, "seed": a.seed,
            "peer_test_events": data["peer_test_events"],
            "machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version(),
            "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
            "load_average": {"start": load_at_start, "end": os.getloadavg()}}
    write(a.out, {"meta": meta, "rows": rows}, markdown(meta, rows))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


def markdown(meta, rows):
    peer = {r["np"]: r.get("events_per_s") for r in rows if r["case"] == ORIGINAL}
    lines = [f"Original: [{meta['peer']}]({meta['peer']}) at commit `{meta['peer_commit']}`, "
             f"TensorFlow {meta['peer_tensorflow']} with tf-keras {meta['peer_tf_keras']} "
             f"(TF_USE_LEGACY_KERAS=1), CPU. {meta['events']} train events, global batch "
             f"{meta['batch']}, {meta['epochs']} epochs, mpilearn's train.seed "
             f"{meta.get('seed', 0)}; physics on {meta['mc_events']} held-out "
             "MC events (`validate --generated`, score and its ratio to the MC-vs-MC floor; "
             f"lower is better). Load average (1 min) {meta['load_average']['start'][0]:.1f} at "
             f"the start, {meta['load_average']['end'][0]:.1f} at the end." + (" **Quick smoke run: tiny sizes, numbers mean nothing.**"
                                     if meta["quick"] else ""), "",
             "| implementation | np | events/s | mpilearn / original | events trained | empty showers "
             "| score | score / floor | sampling-fraction MRE | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "events_per_s" not in r:
            lines.append(f"| {r['case']} | {r['np']} | failed: see the JSON's error | | | | | | | |")
            continue
        ratio = ("" if r["case"] == ORIGINAL or not peer.get(r["np"])
                 else f"{r['events_per_s'] / peer[r['np']]:.2f}")
        ph = r.get("physics") or {}
        fmt = lambda k: f"{ph[k]:.3f}" if isinstance(ph.get(k), (int, float)) else "n/a"  # noqa: E731
        empty = f"{r['empty_showers']:.0%}" if "empty_showers" in r else "n/a"
        lines.append(f"| {r['case']} | {r['np']} | {r['events_per_s']:.3f} | {ratio} | "
                     f"{r['events_trained']} | {empty} | {fmt('score')} | {fmt('score_ratio')} | "
                     f"{fmt('sampling_fraction_mre')} | {r['wall_s']:.0f} |")
    lines += ["", "Empty showers: generated showers with a cell sum <= 10 (GeV x 50), which the "
              "preprocessing drops before scoring (the score stands on the rest); n/a physics: no "
              "shower left to score, or validate failed (the JSON's physics_error)."]
    patch = next((r["patch"] for r in rows if r.get("patch")), "")
    lines += ["", f"Command: `python {meta['command']}`. The original's change, applied to a "
              "temporary copy (its hard-coded epoch and test-pass sizes):", "", "```diff",
              patch.rstrip(), "```"]
    return lines


if __name__ == "__main__":
    main()
