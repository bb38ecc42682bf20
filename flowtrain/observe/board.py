"""A run's TensorBoard event files, written with torch's ``SummaryWriter``.

Layout under the run directory::

    tensorboard/            rank 0: train/*, valid/*, test/*, prequential/*, stream/*, the PR curve, hparams
    tensorboard/worker-R/   with several workers: what differs per worker (worker/*), one directory per rank

Point TensorBoard at it: ``tensorboard --logdir <out>/tensorboard``.

Every record of the run's ``metrics.jsonl`` is mirrored as scalars (``MetricsLog(board=...)``):
a record ``{"kind": "valid", "step": 40, "auc": 0.71, ...}`` becomes the scalar ``valid/auc`` at
step 40. A resumed run drops the events after the step it resumes from (``purge_after``), as it
drops those lines of ``metrics.jsonl``. The writer opens on the first event; importing
TensorBoard takes seconds, so a ``Board`` starts that import in a background thread when it is
made, and the training loop does not wait for it at its first event.
"""
from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import torch

#: Keys of a metrics.jsonl record that are coordinates or labels, not metrics.
NOT_METRICS = {"kind", "model", "step", "epoch", "time"}


def _import_summary_writer() -> None:
    import torch.utils.tensorboard  # noqa: F401 - loaded here, used by Board.writer


class Board:
    """TensorBoard event files of one writer (rank 0's, or one worker's with ``worker``)."""

    def __init__(self, run_dir: str | Path, *, worker: int | None = None, flush_secs: float = 5.0):
        base = Path(run_dir) / "tensorboard"
        self.logdir = base if worker is None else base / f"worker-{worker}"
        self.flush_secs = flush_secs
        self.purge_step: int | None = None
        self.last: dict[str, float] = {}  # newest value of every scalar tag (hparams' final metrics)
        self._writer = None
        threading.Thread(target=_import_summary_writer, name="flowtrain-tensorboard-import", daemon=True).start()

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.logdir), purge_step=self.purge_step,
                                         flush_secs=self.flush_secs)
        return self._writer

    def purge_after(self, step: int) -> None:
        """A resume from ``step``: events written after it by the run before are dropped by TensorBoard."""
        if self._writer is None:
            self.purge_step = int(step) + 1

    def scalars(self, group: str, values: dict[str, Any], step: int) -> None:
        """``group/key`` for every finite number in ``values``."""
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            tag = f"{group}/{key}"
            self.writer.add_scalar(tag, float(value), int(step))
            self.last[tag] = float(value)

    def record(self, record: dict) -> None:
        """One ``metrics.jsonl`` record as scalars ``<kind>/<metric>`` at its step."""
        if "kind" not in record or "step" not in record:
            return
        self.scalars(str(record["kind"]), {k: v for k, v in record.items() if k not in NOT_METRICS},
                     int(record["step"]))

    def pr_curve(self, tag: str, labels, probabilities, step: int = 0) -> None:
        """The precision/recall curve of a binary task (labels 0/1, probabilities of the positive class)."""
        self.writer.add_pr_curve(tag, labels, probabilities, global_step=int(step), num_thresholds=201)

    def hparams(self, hparams: dict[str, Any], metric_tags: list[str] | None = None) -> None:
        """The run's options beside its final metrics (TensorBoard's HPARAMS tab): ``metric_tags``
        (default: every ``test/*`` tag written) with their newest values."""
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        tags = metric_tags if metric_tags is not None else [t for t in self.last if t.startswith("test/")]
        metrics = {t: self.last[t] for t in tags if t in self.last}
        clean = {}
        for key, value in hparams.items():
            if value is None:
                continue
            if isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            clean[key] = value if isinstance(value, (bool, int, float, str)) else str(value)
        exp, ssi, sei = hparams_summary(clean, metrics)
        file_writer = self.writer._get_file_writer()
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def write_batch_results(run_dir: str | Path, *, step: int, test: dict[str, float], hparams: dict[str, Any],
                        labels=None, probabilities=None) -> Path:
    """A batch run's end: the model's test metrics (``test/*`` at the last step), the PR curve of
    a binary task (``test/pr_curve``) and the hyperparameters with those metrics. Returns the directory."""
    board = Board(run_dir)
    board.scalars("test", test, step)
    if labels is not None:
        board.pr_curve("test/pr_curve", torch.as_tensor(labels > 0.5), torch.as_tensor(probabilities), step)
    board.hparams(hparams)
    board.close()
    return board.logdir
