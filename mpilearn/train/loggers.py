"""Where the metrics go besides ``metrics.jsonl`` (``train.log``), written by rank 0.

- ``tensorboard`` (``RUN/tensorboard/``, torch's ``SummaryWriter``): every numeric field of
  each epoch record (``time.compute`` and the like flattened) at its global step, the training
  losses every ``train.log_every_steps`` steps (rank 0's own batches), the physics plots of
  each validation as images, and an HPO fold's hyperparameters with its objective;
- ``csv`` (``RUN/metrics.csv``): one row per epoch, the same flattened fields; the header is
  written anew when a later epoch adds a field (the physics score on validation epochs);
- ``mlflow`` (when installed): the same scalars, in the active or a new MLflow run.

``jsonl`` is always on: ``metrics.jsonl`` is what resume and the HPO read.
"""
from __future__ import annotations

import csv
import io
import os
from typing import Dict, List

from ..errors import UsageError
from ..core.io import atomic_write_text

KINDS = ("jsonl", "tensorboard", "csv", "mlflow")


def check(names) -> None:
    """Bad ``train.log`` values are bad input (exit 2), before training."""
    for name in names:
        if name not in KINDS:
            raise UsageError(f"train.log has {name!r}; choose from {', '.join(KINDS)}")
    if "mlflow" in names:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise UsageError("train.log has 'mlflow' but mlflow is not installed "
                             "(pip install mlflow)") from None
    if "tensorboard" in names:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UsageError("train.log has 'tensorboard' but tensorboard is not installed "
                             "(pip install tensorboard)") from None


def scalars(record: dict, prefix: str = "") -> Dict[str, float]:
    """The numeric leaves of an epoch record, with dotted names."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
            out[f"{prefix}{key}"] = float(value)
    return out


class Loggers:
    def __init__(self, names, output: str):
        self.output, self.names = output, list(names)
        self.tb = self.mlflow = None
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output, "tensorboard"))
        if "mlflow" in self.names:
            import mlflow

            self.mlflow = mlflow
            if mlflow.active_run() is None:
                mlflow.start_run(run_name=os.path.basename(os.path.abspath(output)))

    def steps(self, step: int, losses: Dict[str, float]) -> None:
        if self.tb is not None:
            for k, v in losses.items():
                self.tb.add_scalar(f"step/train_{k}", v, step)

    def epoch(self, record: dict) -> None:
        values = {k: v for k, v in scalars(record).items() if k not in ("epoch", "step")}
        step = record.get("step", record.get("epoch", 0))
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"epoch/{k}", v, step)
            self.tb.flush()
        if "csv" in self.names:
            self._csv_row({"epoch": record.get("epoch"), "step": record.get("step"), **values})
        if self.mlflow is not None:
            self.mlflow.log_metrics({k.replace(".", "/"): v for k, v in values.items()}, step=step)

    def images(self, epoch: int, paths: List[str]) -> None:
        if self.tb is None:
            return
        import matplotlib.image

        for path in paths:
            image = matplotlib.image.imread(path)[..., :3]  # RGBA PNG -> RGB, HWC in [0, 1]
            name = os.path.splitext(os.path.basename(path))[0]
            self.tb.add_image(f"validation/{name}", image, epoch, dataformats="HWC")
        self.tb.flush()

    def hparams(self, params: dict, metrics: dict) -> None:
        """An HPO fold: its hyperparameters and final objective, for TensorBoard's HParams tab."""
        if self.tb is not None:
            plain = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                     for k, v in params.items()}
            self.tb.add_hparams(plain, {f"hparam/{k}": v for k, v in metrics.items()},
                                run_name=".")
            self.tb.close()

    def _csv_row(self, row: dict) -> None:
        """Appends a row; rewrites the file only when the row brings a new column."""
        path = os.path.join(self.output, "metrics.csv")
        row = {k: ("" if v is None else v) for k, v in row.items()}
        rows, fields = [], []
        if os.path.exists(path):
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                fields = list(reader.fieldnames or [])
                if set(row) <= set(fields):
                    with open(path, "a", newline="") as out:
                        csv.DictWriter(out, fieldnames=fields, restval="").writerow(row)
                    return
                rows = list(reader)
        fields = list(dict.fromkeys([*fields, *row]))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows([*rows, row])
        atomic_write_text(path, buf.getvalue())

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
