"""A machine-sensor table made in the test: a 3-class label, numerics, an optional numeric, a text
and an integer category, an hourly time column (not a table the suite uses elsewhere)."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np

#: ``flowtrain batch`` options for the table (the spec the stream reads back from the manifest).
SPEC_OPTIONS = ["--label", "state", "--task", "classification", "--numeric", "temp,pressure",
                "--optional-numeric", "humidity", "--categorical", "site,machine", "--time-column", "ts"]
CLASSES = ("fail", "ok", "warn")
START = dt.datetime(2024, 3, 1)


def sensor_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows as dicts; the state follows temp, pressure and site; a few rows lack pressure (batch dead
    letters) or humidity (the mean); ``site`` "rare" occurs once (out of vocabulary with min count 2)."""
    rng = np.random.default_rng(seed)
    temp = rng.normal(60, 10, size=n).round(3)
    pressure = rng.normal(1.0, 0.2, size=n).round(4)
    humidity = rng.uniform(20, 80, size=n).round(2)
    site = rng.choice(["north", "south", "east"], size=n)
    machine = rng.integers(1, 7, size=n)
    score = (temp - 60) / 10 + 2 * (pressure - 1.0) + 0.8 * (site == "east")
    state = np.where(score > 0.9, "fail", np.where(score > -0.3, "warn", "ok"))
    rows = []
    for i in range(n):
        rows.append({"ts": (START + dt.timedelta(minutes=7 * i)).strftime("%Y-%m-%dT%H:%M:%S"),
                     "temp": float(temp[i]), "pressure": None if i % 97 == 5 else float(pressure[i]),
                     "humidity": None if i % 10 == 3 else float(humidity[i]),
                     "site": "rare" if i == n // 2 else str(site[i]), "machine": int(machine[i]),
                     "state": str(state[i])})
    return rows


def write_csv(path: str | Path, rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = [",".join(cols)] + [",".join("" if r[c] is None else str(r[c]) for c in cols) for r in rows]
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)


def make_sensor_run(base, *, rows: int = 1500, epochs: int = 2, extra: tuple[str, ...] = ()) -> tuple[str, Path, str]:
    """CSV -> ``flowtrain batch`` (ETL + a short training) -> (dataset dir, run dir, csv path)."""
    from flowtrain.cli.main import main

    base = Path(base)
    csv = write_csv(base / "sensors.csv", sensor_rows(rows))
    run = base / "batch"
    rc = main(["batch", "--input", csv, *SPEC_OPTIONS, "--min-count", "2", "--epochs", str(epochs),
               "--batch-size", "64", "--threads", "1", "--no-progress", "--out", str(run), *extra])
    assert rc == 0, "flowtrain batch on the sensor table failed"
    return str(run / "dataset"), run, csv
