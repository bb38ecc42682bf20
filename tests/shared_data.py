"""The suite's small datasets and runs, each made once per session: a real flights ETL, a real `flowtrain batch`
on the synthetic regression table, on the sensor table. The ``shared_data`` fixture (tests/conftest.py) hands out
one :class:`SharedData`; pytest-xdist's workers share its folder, the first to ask builds under a file lock.

What it returns is shared: a test reads it, and a test that changes a dataset or a run works on a copy of it
(``shutil.copytree``); the fixture fails the session when a file of one changed (``SharedData.changed``)."""
from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from tests.flights_data import make_flights_dataset
from tests.sensor_data import make_sensor_run
from tests.synthetic_data import make_regression_run


class SharedData:
    """Datasets and runs by their parameters, built once under ``root`` and reused."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._made: dict[str, object] = {}

    def _once(self, name: str, make: Callable[[Path], object]) -> object:
        """``make(folder)``'s JSON-able result, made once per name by whichever process asks first."""
        if name in self._made:
            return self._made[name]
        folder, result = self.root / name, self.root / f"{name}.json"
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not result.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a build that failed half way left
                folder.mkdir()
                made = make(folder)
                (self.root / f"{name}.files").write_text(json.dumps(_files(folder)))
                result.write_text(json.dumps(made))
            self._made[name] = json.loads(result.read_text())
        return self._made[name]

    def changed(self) -> dict[str, list[str]]:
        """What a test changed in what this process handed out: ``{name: [path, ...]}`` of the files added,
        removed or rewritten since it was made (a test must change a copy instead)."""
        found = {}
        for name in self._made:
            then = json.loads((self.root / f"{name}.files").read_text())
            now = _files(self.root / name)
            diff = sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))
            if diff:
                found[name] = diff
        return found

    def flights(self, every: int) -> str:
        """The flights ETL on every ``every``-th flight (``tests.flights_data``): its dataset directory."""
        return self._once(f"flights-every-{every}", lambda d: make_flights_dataset(d, every=every))

    def regression_run(self, *, hidden: str = "32,16", epochs: int = 3, rows: int = 1200) -> tuple[str, Path]:
        """``tests.synthetic_data.make_regression_run``: (dataset dir, run dir)."""
        def make(d: Path):
            dataset, run = make_regression_run(d, hidden=hidden, epochs=epochs, rows=rows)
            return [dataset, str(run)]

        dataset, run = self._once(f"regression-{hidden.replace(',', 'x')}-e{epochs}-r{rows}", make)
        return dataset, Path(run)

    def regression_dataset(self, rows: int) -> str:
        """The synthetic regression table's dataset of ``rows`` rows: it depends on the rows only, not on the
        training, so it is the default run's (with 1200 rows, the run ``regression_run()`` hands out)."""
        return self.regression_run(rows=rows)[0]

    def sensor_run(self, *, rows: int = 1500, epochs: int = 2) -> tuple[str, Path, str]:
        """``tests.sensor_data.make_sensor_run``: (dataset dir, run dir, csv path)."""
        def make(d: Path):
            dataset, run, csv = make_sensor_run(d, rows=rows, epochs=epochs)
            return [dataset, str(run), csv]

        dataset, run, csv = self._once(f"sensor-r{rows}-e{epochs}", make)
        return dataset, Path(run), csv


def _files(folder: Path) -> dict[str, list[int]]:
    """Every file under ``folder``: its size and modification time."""
    return {str(p.relative_to(folder)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}

