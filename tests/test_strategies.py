"""Local SGD (train.algorithm: local_sgd), the strategy added to show that a new algorithm is
one class: it computes what allreduce does when it averages every step, its ranks agree at
each epoch's end, and a kill -9 between two averages resumes exactly (per-rank optimizer
states are checkpointed); Keras models are averaged through their adapter."""
import os

import torch

from conftest import TESTS, REPO, kill9_after_mid_epoch_checkpoint, mpirun, train_args
from mpilearn.train import checkpoint as ckpt


def args(toy_file, out, *sets, model=f"{REPO}/models/mlp.py"):
    extra = [x for s in sets for x in ("--set", s)]
    return train_args("--set", f"model={model}", "--set", f"data.files=[{toy_file}]",
                      "--set", "train.batch_size=16", "--set", "train.deterministic=true",
                      "--set", "hparams.optimizer=sgd", "--set", "hparams.momentum=0.9",
                      *extra, "--output", out)


def last_state(out):
    return ckpt.load(ckpt.latest(os.path.join(out, "checkpoints")))


def test_local_sgd_averaging_every_step_equals_allreduce(toy_file, tmp_path):
    # SGD with momentum is linear in the gradients: averaging the weights after every step
    # gives the step on the averaged gradient, which is what allreduce computes
    runs = {}
    for name, sets in (("allreduce", ["train.epochs=2"]),
                       ("local", ["train.epochs=2", "train.algorithm=local_sgd",
                                  "train.sync_every=1"])):
        out = str(tmp_path / name)
        proc = mpirun(2, args(toy_file, out, *sets))
        assert proc.returncode == 0, proc.stderr
        runs[name] = last_state(out)["task"]["models"]["model"]
    for k, want in runs["allreduce"].items():
        torch.testing.assert_close(runs["local"][k], want, rtol=1e-5, atol=1e-6)


def test_local_sgd_ranks_agree_after_each_epoch_and_differ_from_allreduce(toy_file, tmp_path):
    out = str(tmp_path / "k4")
    proc = mpirun(3, args(toy_file, out, "train.epochs=1", "train.algorithm=local_sgd",
                          "train.sync_every=4", "train.max_steps_per_epoch=10"))
    assert proc.returncode == 0, proc.stderr
    state = last_state(out)
    mine = state["task"]["models"]["model"]
    others = state["strategy"]["ranks"]
    assert others[0] is None and len(others) == 3
    for other in others[1:]:
        for k, v in mine.items():  # the weights are averaged at the epoch's end...
            torch.testing.assert_close(other["models"]["model"][k], v, rtol=0, atol=0)
        # ... the momentum buffers are each rank's own
        assert not torch.equal(other["optimizers"]["optimizer"]["state"][0]["momentum_buffer"],
                               state["task"]["optimizers"]["optimizer"]["state"][0]["momentum_buffer"])
    sync = str(tmp_path / "sync")
    proc = mpirun(3, args(toy_file, sync, "train.epochs=1", "train.max_steps_per_epoch=10"))
    assert proc.returncode == 0, proc.stderr
    want = last_state(sync)["task"]["models"]["model"]
    assert max(float((mine[k] - want[k]).abs().max()) for k in want) > 1e-4


def test_local_sgd_kill9_between_averages_then_resume_matches_uninterrupted(toy_file, tmp_path):
    def run_args(out):
        return args(toy_file, out, "train.epochs=2", "train.algorithm=local_sgd",
                    "train.sync_every=5", "train.checkpoint_every_steps=3", "hparams.sleep=0.04",
                    model=f"{TESTS}/models/slow.py")

    whole = str(tmp_path / "whole")
    proc = mpirun(2, run_args(whole))
    assert proc.returncode == 0, proc.stderr
    cut = str(tmp_path / "cut")
    # checkpoints every 3 steps, averages every 5: most checkpoints lie between two averages
    kill9_after_mid_epoch_checkpoint(2, run_args(cut), cut, epoch=0)
    proc = mpirun(2, run_args(cut) + ["--resume"])
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr
    got, want = last_state(cut), last_state(whole)
    assert got["epoch"] == want["epoch"] == 2
    for k, v in want["task"]["models"]["model"].items():
        torch.testing.assert_close(got["task"]["models"]["model"][k], v, rtol=0, atol=0)


def test_local_sgd_averages_keras_models_through_their_adapter(toy_file, tmp_path):
    out = str(tmp_path / "keras")
    proc = mpirun(2, train_args("--set", f"model={REPO}/models/keras_mlp.py",
                                "--set", f"data.files=[{toy_file}]", "--set", "train.batch_size=16",
                                "--set", "train.epochs=1", "--set", "train.max_steps_per_epoch=10",
                                "--set", "train.algorithm=local_sgd", "--set", "train.sync_every=3",
                                "--output", out), env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    state = last_state(out)
    mine, other = state["task"], state["strategy"]["ranks"][1]
    for a, b in zip(mine["models"]["model"], other["models"]["model"]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # averaged at the epoch's end
    # Adam's moments are each rank's own (after 10 steps on different data)
    assert any(not torch.equal(a, b) for a, b in zip(mine["optimizers"]["optimizer"],
                                                     other["optimizers"]["optimizer"]))


def test_local_sgd_resumed_at_another_size_between_averages_starts_from_the_ranks_mean():
    """A checkpoint written between two averages holds each rank's own model: a resume at
    another rank count starts from their mean (no rank's steps dropped) with rank 0's optimizer
    state; one written at an average keeps rank 0's model (every rank's, bit for bit)."""
    from mpi4py import MPI

    import mpilearn
    from mpilearn.train import SupervisedTask
    from mpilearn.train.strategies import LocalSGD

    mpilearn.init()

    def task(fill):
        model = torch.nn.Linear(2, 1).double()
        torch.nn.init.constant_(model.weight, fill)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt.state[model.weight]["momentum_buffer"] = torch.full((1, 2), fill, dtype=torch.float64)
        return SupervisedTask(model, torch.nn.functional.mse_loss, opt)

    saved = [task(fill).state_dict() for fill in (1.0, 2.0, 6.0)]  # ranks 0, 1, 2
    for synced, weight in ((False, 3.0), (True, 1.0)):
        resumed = task(0.0)  # as the engine loads a checkpoint: rank 0's task, then the strategy
        strategy = LocalSGD({"backend": "mpi", "sync_every": 4}, MPI.COMM_SELF)
        strategy.setup(resumed, "cpu")
        resumed.load_state_dict(saved[0])
        strategy.load_state_dict({"ranks": [None, *saved[1:]], "synced": synced})
        assert resumed.model.weight.tolist() == [[weight, weight]] and strategy.synced
        assert resumed.optimizer.state[resumed.model.weight]["momentum_buffer"].tolist() == \
            [[1.0, 1.0]]
