"""The 3DGAN training protocol as a task: per batch 2 discriminator and 2 generator updates.

One batch (reference 3dgan.md §2c): D on the real batch (labels 1 flipped with p=0.05), D on
a fake batch made by G in inference mode from the real batch's (E, θ) (labels 0 flipped),
then twice G through a frozen D with label 1 and the same auxiliary targets.

Distributed semantics:
  * every optimizer step averages its gradients across ranks with one fused allreduce;
  * losses are averaged over the *global* batch: each rank scales its summed per-event losses
    by 1 / global event count and the PyTorch optimizers sum the gradients (Keras: by
    ranks / global event count, and its optimizers average), which gives the global-batch mean
    even when the Σ > 10 filter leaves ranks with different event counts;
  * label flips and noise are drawn per (step, global event index), so N ranks draw exactly
    what one rank with the whole batch draws;
  * batch-norm statistics are local to each rank (as in Horovod and TF mirrored training): the
    only thing that differs from one rank with an N-times larger batch.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import torch

from .draws import box_muller, to_unit, uniform_words
from .format import GEOMETRY, SAMPLED_ENERGY, Preprocess, ecal_fit
from ..allreduce.noise import measure_halves
from ..train.guard import Snapshot, flagged_step, read_host
from ..train.tasks import Task, TrainingStopped

DEFAULT_WEIGHTS = {"angle": [3.0, 0.1, 25.0, 0.1], "fixed": [2.0, 0.1, 0.1]}
TERMS = {"angle": ["bce", "aux", "angle", "ecal"], "fixed": ["bce", "aux", "ecal"]}
LATENT = {"angle": 256, "fixed": 200}
EMPTY_GUARD_BATCHES = 10


def build_networks(hp: dict, fixed, angle, small, smooth=None):
    """(G, D) from the builder that ``hp``'s variant and preset name, called with
    (batch_norm, dropout); the PyTorch and the Keras model files share this choice (the
    ``smooth`` preset: PyTorch only, so far)."""
    if hp["variant"] == "fixed":
        builder = fixed
    elif hp["variant"] == "angle":
        builders = {"small": small, "smooth": smooth}
        builder = builders.get(hp["preset"]) or angle
        if hp["preset"] == "smooth" and smooth is None:
            raise ValueError("hparams.preset smooth has no Keras builder yet: use small or full")
    else:
        raise ValueError(f"hparams.variant must be angle or fixed, got {hp['variant']!r}")
    return builder(bool(hp["batch_norm"]), float(hp["dropout"]))


def _clip(p):
    return p.clamp(1e-7, 1 - 1e-7)


def _mape(label, pred):
    """Keras MAPE: divides by the label (not the prediction, as some ports do)."""
    return 100.0 * (label - pred).abs() / label.abs().clamp_min(1e-7)


class GANProtocol:
    """The framework-neutral half of the 3DGAN protocol, shared by the PyTorch
    (:class:`GANTask`) and Keras (``calo.keras_gan.KerasGANTask``) tasks: loss weights and names,
    data keys and preprocessing, the per-event draws, the fake batches' conditions, the
    global-batch scale, the reported means and the guards. Each framework writes only its four
    updates, evaluation and generation."""

    generator = discriminator = g_opt = d_opt = None

    def _init_protocol(self, variant: str, loss_weights, label_flip: float, angle_key: str,
                       seed: int) -> None:
        if variant not in TERMS:
            raise ValueError(f"variant must be angle or fixed, got {variant!r}")
        self.variant = variant
        weights = list(DEFAULT_WEIGHTS[variant])
        if isinstance(loss_weights, dict):  # {index: weight} overrides, e.g. from an HPO space
            for i, w in loss_weights.items():
                weights[int(i)] = w
        elif loss_weights:
            weights = list(loss_weights)
        if len(weights) != len(TERMS[variant]):
            raise ValueError(f"loss_weights needs {len(TERMS[variant])} values for the {variant} "
                             f"model ({', '.join(TERMS[variant])}), got {len(weights)}")
        self.weight_values = [float(w) for w in weights]
        self.label_flip, self.seed = label_flip, seed
        self.preprocess = Preprocess(variant, angle_key)
        self.keys = ["ECAL", "energy"] if variant == "angle" else ["ECAL"]
        self.optional_keys = [angle_key] if variant == "angle" else ["energy", "target"]
        self.latent = LATENT[variant]
        terms = TERMS[variant]
        self.loss_names = ["d_loss", "g_loss", "d_real", "d_fake", *(f"g_{t}" for t in terms)]
        self.val_names = ["d_loss", "g_loss"]
        self.steps = 0          # training steps so far: part of the per-sample RNG key
        self.empty_batches = 0  # consecutive batches with empty generated images
        self.comm = None

    def models(self):
        return {"generator": self.generator, "discriminator": self.discriminator}

    def optimizers(self):
        return {"generator": self.g_opt, "discriminator": self.d_opt}

    def transform(self, batch):
        return self.preprocess(batch)

    def callbacks(self, config: dict) -> tuple:
        """The training ranges' record, and physics validation every ``train.validate_every``
        epochs (0: none)."""
        from .callbacks import PhysicsValidation, TrainingRanges

        return (TrainingRanges,) + ((PhysicsValidation,) if config["train"]["validate_every"] else ())

    def test_metrics(self, files, comm, output: str, config: dict) -> dict:
        """Collective: the physics numbers on the test files (``train.physics_events`` compared,
        as many again for the MC-vs-MC floor), plots in ``RUN/validation/test``."""
        import os

        from .physics import validate_task

        result = validate_task(self, files, np.arange(len(files)), comm,
                               os.path.join(output, "validation", "test"),
                               config["train"]["physics_events"], title="test files",
                               classifier=True)
        # "events" would clash with the validation pass's count of test events
        return {("physics_events" if k == "events" else k): v for k, v in result.items()
                if not isinstance(v, (list, dict))}

    @staticmethod
    def test_summary(result: dict) -> str:
        """The test report's line: the headline numbers with their floor ratios."""
        from .callbacks import short_line

        return short_line(result)

    def check_files(self, files) -> None:
        """Rank 0, before training: shapes, energy key and finite cells in each file."""
        import h5py

        from ..errors import UsageError

        shape = GEOMETRY[self.variant]["shape"]
        from ..cluster.stage import local

        for path in files.paths:
            with h5py.File(local(path), "r") as f:
                ecal = f["ECAL"]
                if ecal.shape[1:] != shape:
                    raise UsageError(f"{path}: dataset 'ECAL' has events of shape {ecal.shape[1:]}, "
                                     f"expected {shape} for the {self.variant} model")
                if "energy" not in f and "target" not in f:
                    raise UsageError(f"{path}: no dataset 'energy' (or 'target') with the "
                                     "primary energy")
                head = ecal[:256]
                if not np.isfinite(head).all():
                    raise UsageError(f"{path}: dataset 'ECAL' has NaN or infinite cells")

    # first in both tasks' MRO: super() is the framework's Task (models and optimizers)
    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "gan": {"steps": self.steps, "empty_batches": self.empty_batches}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.steps = state["gan"]["steps"]
        self.empty_batches = state["gan"]["empty_batches"]

    # -- per-sample randomness ---------------------------------------------------------
    def _draws(self, index: np.ndarray, step: int, purpose: int = 0, device=None):
        """Label-flip uniforms (N, 2), latent noise (3, N, latent) and sampled energy labels
        E'/100 (3, N; used by the 25x25x25 model's fake batches) for the global events
        ``index``, keyed by (seed, purpose, step, event): 0 = training, 1 = generation and
        evaluation (``draws.py``: Philox, the same numbers for an event on any rank count).
        On the host as float32 numpy arrays, or, with ``device``, as tensors of the task's
        dtype drawn there (the bits are the same; the floats agree to rounding).
        """
        d = self.latent - (2 if self.variant == "angle" else 0)
        xp = np if device is None else torch
        u = to_unit(uniform_words(index, step, purpose, self.seed, 5 + 3 * d, xp, device), xp)
        n = u.shape[0]
        flips = u[:, :2]
        noise = box_muller(u[:, 2:2 + 3 * d], xp).reshape(n, 3, d)
        sampled = SAMPLED_ENERGY[0] + (SAMPLED_ENERGY[1] - SAMPLED_ENERGY[0]) * u[:, 2 + 3 * d:]
        if xp is np:
            return (flips.astype(np.float32), np.ascontiguousarray(noise.transpose(1, 0, 2), np.float32),
                    np.ascontiguousarray(sampled.T, np.float32))
        return (flips, noise.transpose(0, 1).contiguous().to(self.dtype),
                sampled.T.contiguous().to(self.dtype))

    def generation_noise(self, index: np.ndarray, device=None):
        """The latent noise of generated events ``index`` (N, latent - conditions): keyed by
        (seed, event) only, so any split of the events over ranks or batches draws the same;
        numpy on the host, or a tensor drawn on ``device``."""
        return self._draws(index, 0, purpose=1, device=device)[1][0]

    def fake_conditions(self, k: int, energy, angle, ecal, sampled):
        """(E/100, θ, Σ) of fake set ``k`` (0: D's fake batch, 1-2: the two G updates), the
        generator's conditioning and the auxiliary targets alike (reference 3dgan.md §2a/§2c).
        The angle model reuses the real batch's; the 25x25x25 model samples E' ~ U(10, 500)
        GeV per event and set, and takes Σ from the reference's fit."""
        if self.variant == "angle":
            return energy, angle, ecal
        return sampled[k], None, ecal_fit(sampled[k])

    def _begin_step(self, batch, device=None):
        """Event counts, the global-batch loss scale and this step's draws (one step on; on
        ``device`` where given)."""
        n_local = len(batch["energy"])
        size = self.comm.Get_size() if self.comm is not None else 1
        n_global = self.comm.allreduce(n_local) if size > 1 else n_local
        flips, noise, sampled = self._draws(batch["_index"], self.steps, device=device)
        self.steps += 1
        ranks = 1 if self.sums_gradients else size
        return n_local, n_global, ranks / max(n_global, 1), flips, noise, sampled

    def _report(self, sums, n_global: int, undo=None) -> Dict[str, float]:
        """Global-batch means of every term (one small allreduce), and the empty-image guard;
        ``sums`` (4 updates x terms, summed over local events) as a tensor or an array;
        ``undo()`` runs before a non-finite loss stops training."""
        local = np.asarray(sums.cpu() if hasattr(sums, "cpu") else sums, np.float64).reshape(-1)
        total = self.comm.allreduce(local) if self.comm is not None and self.comm.Get_size() > 1 else local
        means = total.reshape(4, -1) / max(n_global, 1)
        w = np.asarray(self.weight_values, np.float64)
        names = TERMS[self.variant]
        out = {"d_loss": float((means[0] @ w + means[1] @ w) / 2),
               "g_loss": float((means[2] @ w + means[3] @ w) / 2)}
        g_terms = (means[2] + means[3]) / 2
        out.update({f"g_{n}": float(v) for n, v in zip(names, g_terms)})
        out.update({"d_real": float(means[0] @ w), "d_fake": float(means[1] @ w)})
        if not np.isfinite(means).all():
            if undo is not None:
                undo()
            raise TrainingStopped(f"a loss is NaN or infinite: {out}")
        # the guard reads the ecal term (the reference read the angle term by mistake)
        # empty images have a cell sum of 0: a MAPE of exactly 100 %
        self.empty_batches = self.empty_batches + 1 if abs(g_terms[-1] - 100.0) < 1e-3 else 0
        if self.empty_batches >= EMPTY_GUARD_BATCHES:
            raise TrainingStopped(f"the generator emitted empty images for {self.empty_batches} "
                                  f"batches in a row (ecal MAPE {g_terms[-1]:.2f} %)")
        return out


class GANTask(GANProtocol, Task):
    """The 3DGAN protocol with PyTorch models: the four updates of a batch, evaluation and
    generation."""

    folds_average = True

    def __init__(self, generator: torch.nn.Module, discriminator: torch.nn.Module,
                 g_optimizer, d_optimizer, variant: str = "angle",
                 loss_weights: Optional[Sequence[float]] = None, label_flip: float = 0.05,
                 angle_key: str = "mtheta", seed: int = 0, dtype=torch.float32):
        self._init_protocol(variant, loss_weights, label_flip, angle_key, seed)
        self.generator, self.discriminator = generator.to(dtype), discriminator.to(dtype)
        self.dtype = dtype
        self.g_opt, self.d_opt = g_optimizer, d_optimizer
        self.weights = torch.tensor(self.weight_values, dtype=dtype)

    def setup(self, comm, device, backend, fusion_bytes, distributed=True):
        super().setup(comm, device, backend, fusion_bytes, distributed)
        self.comm = comm
        self.weights = self.weights.to(device)

    def latent_input(self, noise, energy, angle):
        if self.variant == "angle":
            return torch.cat([energy[:, None], angle[:, None], noise], dim=1)
        return energy[:, None] * noise

    # -- losses ------------------------------------------------------------------------
    def _terms(self, outputs, label, energy, angle, ecal):
        """Per-event loss terms, (N, n_terms), unweighted, in the task's dtype (bf16
        autocast outputs are upcast: the logs and MAPEs need the precision)."""
        outputs = [o.to(self.dtype) for o in outputs]
        p, aux = outputs[0], outputs[1]
        bce = -(label * torch.log(_clip(p)) + (1 - label) * torch.log(1 - _clip(p)))
        terms = [bce, _mape(energy, aux)]
        if self.variant == "angle":
            terms.append((angle - outputs[2]).abs())
        terms.append(_mape(ecal, outputs[-1]))
        return torch.stack(terms, dim=1)

    def _update(self, model_out, opt, label, targets, scale, flags):
        """One optimizer step on sum-over-events x scale, unread (its finite flag is appended
        to ``flags``); returns the local term sums, on the device."""
        terms = self._terms(model_out, label, *targets)
        loss = (terms * self.weights).sum() * scale
        h = len(terms) // 2
        if h:  # one rank: the noise scale from two halves, now and then (allreduce/noise.py)
            measure_halves(opt, lambda: (terms[:h] * self.weights).sum() * scale)
        loss.backward()
        flags.append(flagged_step(opt))
        return terms.detach().sum(0)

    def train_step(self, batch) -> Dict[str, float]:
        """The four updates with one host read at the end (their finite flags and the loss
        sums, guard.py): a batch with a non-finite update is undone from the snapshot taken
        here and stops training, so no non-finite step is kept or checkpointed."""
        G, D = self.generator, self.discriminator
        n_local, n_global, scale, flips, noise, sampled = self._begin_step(batch, self.device)
        k = len(TERMS[self.variant])
        snapshot = Snapshot(self.models().values(), list(self.optimizers().values()))
        flags = []
        if n_local == 0:  # all events filtered here: take part in the allreduces with zeros
            sums = [torch.zeros(k, device=self.device, dtype=self.dtype)] * 4
            for opt in (self.d_opt, self.d_opt, self.g_opt, self.g_opt):
                opt.zero_grad()
                flags.append(flagged_step(opt))  # stops with the others on their NaNs
        else:
            real = self.tensor(batch["images"]).unsqueeze(1)
            energy, ecal = self.tensor(batch["energy"]), self.tensor(batch["ecal"])
            angle = self.tensor(batch["angle"]) if self.variant == "angle" else None
            targets = (energy, angle, ecal)
            flip = flips < self.label_flip
            ones = torch.ones(n_local, device=self.device, dtype=self.dtype)
            zeros = torch.zeros(n_local, device=self.device, dtype=self.dtype)
            G.train(), D.train()
            # 1. discriminator on the real batch
            self.d_opt.zero_grad()
            with self.autocast():
                out = D(real)
            sums = [self._update(out, self.d_opt, torch.where(flip[:, 0], zeros, ones),
                                 targets, scale, flags)]
            # 2. discriminator on a fake batch from G in inference mode
            fake_targets = self.fake_conditions(0, *targets, sampled)
            with torch.no_grad(), self.autocast():
                G.eval()
                fake = G(self.latent_input(noise[0], *fake_targets[:2]))
                G.train()
            self.d_opt.zero_grad()
            with self.autocast():
                out = D(fake)
            sums.append(self._update(out, self.d_opt, torch.where(flip[:, 1], ones, zeros),
                                     fake_targets, scale, flags))
            # 3-4. generator twice through the frozen discriminator, label "real"
            D.requires_grad_(False)
            try:
                for j in (2, 3):
                    self.g_opt.zero_grad()
                    g_targets = self.fake_conditions(j - 1, *targets, sampled)
                    with self.autocast():
                        out = D(G(self.latent_input(noise[j - 1], *g_targets[:2])))
                    sums.append(self._update(out, self.g_opt, ones, g_targets, scale, flags))
            finally:
                D.requires_grad_(True)
        host = read_host(torch.cat([torch.stack(flags).to(self.dtype), torch.stack(sums).reshape(-1)]))
        bad = [i + 1 for i, ok in enumerate(host[:4]) if not ok]
        if bad:
            snapshot.restore()
            raise TrainingStopped(f"non-finite gradients, step skipped (3DGAN update {bad[0]} of 4: "
                                  "the batch's updates were undone)")
        return self._report(host[4:], n_global, undo=snapshot.restore)

    # -- evaluation and generation -----------------------------------------------------
    @torch.no_grad()
    def generate(self, energy_label: np.ndarray, angle: Optional[np.ndarray],
                 index: np.ndarray) -> np.ndarray:
        """Preprocessed-space showers for (E/100, θ); noise keyed by the event index."""
        self.generator.eval()
        e = self.tensor(energy_label)
        a = self.tensor(angle) if angle is not None else None
        out = self.generator(self.latent_input(self.generation_noise(index, self.device), e, a))
        return out.squeeze(1).cpu().numpy()

    @torch.no_grad()
    def discriminate(self, images: np.ndarray) -> Dict[str, np.ndarray]:
        """D in inference mode on preprocessed-space showers: P(real) and the auxiliary energy
        in GeV, per event (the validation plots' discriminator outputs)."""
        self.discriminator.eval()
        out = self.discriminator(self.tensor(images).unsqueeze(1))
        return {"real": out[0].reshape(-1).double().cpu().numpy(),
                "energy": 100.0 * out[1].reshape(-1).double().cpu().numpy()}

    @torch.no_grad()
    def eval_batch(self, batch):
        G, D = self.generator, self.discriminator
        G.eval(), D.eval()
        n = len(batch["energy"])
        if n == 0:
            return {"d_loss": 0.0, "g_loss": 0.0}
        real = self.tensor(batch["images"]).unsqueeze(1)
        energy, ecal = self.tensor(batch["energy"]), self.tensor(batch["ecal"])
        angle = self.tensor(batch["angle"]) if self.variant == "angle" else None
        fake = self.tensor(self.generate(batch["energy"], batch.get("angle"), batch["_index"])).unsqueeze(1)
        targets = (energy, angle, ecal)
        ones, zeros = torch.ones(n, device=self.device), torch.zeros(n, device=self.device)
        d_real = (self._terms(D(real), ones, *targets) * self.weights).sum()
        out_fake = D(fake)
        d_fake = (self._terms(out_fake, zeros, *targets) * self.weights).sum()
        g = (self._terms(out_fake, ones, *targets) * self.weights).sum()
        return {"d_loss": float(d_real + d_fake) / 2, "g_loss": float(g)}
