"""A small synthetic regression table, run through the real `flowtrain batch` (ETL + training)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def make_regression_run(base, *, hidden: str = "32,16", epochs: int = 3, rows: int = 1200) -> tuple[str, Path]:
    """``y = 3x + 2[c == a] + noise`` as CSV -> ``flowtrain batch`` -> (dataset dir, run dir).

    The run is trained with non-default ``hidden`` sizes and dropout 0.1, so code that starts from
    it must take the architecture from the run."""
    from flowtrain.cli.main import main

    base = Path(base)
    rng = np.random.default_rng(0)
    x = rng.normal(size=rows)
    c = rng.choice(["a", "b", "c"], size=rows)
    y = 3 * x + 2 * (c == "a") + rng.normal(scale=0.1, size=rows)
    csv = base / "data.csv"
    csv.write_text("x,c,y\n" + "".join(f"{x[i]:.6f},{c[i]},{y[i]:.6f}\n" for i in range(rows)))
    run = base / "batch"
    rc = main(["batch", "--input", str(csv), "--label", "y", "--task", "regression", "--numeric", "x",
               "--categorical", "c", "--hidden", hidden, "--dropout", "0.1", "--epochs", str(epochs),
               "--batch-size", "64", "--threads", "1", "--no-progress", "--out", str(run)])
    assert rc == 0, "flowtrain batch on the synthetic table failed"
    return str(run / "dataset"), run
