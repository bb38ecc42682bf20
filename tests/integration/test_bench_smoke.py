"""Benchmarks that cannot rot (#43 item 6): every `flowtrain bench NAME` runs once in `make test`, at a tiny size,
through the command line, and prints its table. Nothing is timed or compared here: the numbers of a shared 2-core
machine mean nothing; what is checked is that each bench's code still runs end to end (`flowtrain bench serve`
crashed on a renamed config field for a wave, unseen by any test).

Every bench gets one round (``bench.timing.MIN_REPEATS`` lifted to 1 in the bench's process only), its smallest
cases and the flights demo cut to every 100th flight (``tests/bench_preset.py``, the default dataset preset through
``$FLOWTRAIN_PRESETS``). The benches that take a broker or a Flink cluster get the session's (``--bootstrap``,
``--cluster-dir``) instead of starting their own. All but `flink` run one after another in two processes
(``tests/bench_smoke_child.py``: torch and Beam imported once in each), each process a group of its own
(``SMOKE_GROUPS``, about half the seconds each: under `make test`'s load one process of all of them took 760-900+
s), `flink` in a process of its own on the worker that holds the session's Flink cluster. A bench added to
``flowtrain.cli.bench.BENCHMARKS`` without a tiny size in ``TINY`` fails until it gets one."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowtrain.cli.bench import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]
#: Each bench's options for a run of seconds: the fewest rows, steps and cases that still run all of its code.
TINY = {
    "kafka": ["--records", "400", "--repeats", "1"],
    "etl": ["--scales", "1", "--repeats", "1"],
    "loader": ["--batch-size", "256", "--repeats", "1", "--memory-budget", "64KB"],
    "train-scale": ["--scales", "1", "--batch-size", "256", "--steps", "3", "--repeats", "1",
                    "--memory-budget", "64KB"],
    "dataparallel": ["--steps", "3", "--global-batch", "64", "--repeats", "1", "--models", "demo"],
    "pipeline": ["--steps", "2", "--batch", "32", "--repeats", "1", "--bubble-microbatches", "4"],
    "tensor": ["--steps", "2", "--batch", "8", "--d-model", "8", "--hidden", "16", "--blocks", "1", "--repeats", "1"],
    "memory": ["--workers", "2", "--steps", "2", "--batch", "8", "--d-model", "8", "--hidden", "16", "--blocks", "1",
               "--repeats", "1"],
    "stream": ["--events", "300", "--latency-seconds", "1", "--latency-rates", "300", "--repeats", "1"],
    "flink": ["--scales", "1", "--repeats", "1", "--no-warmup"],
    "serve": ["--events", "300", "--rate", "100", "--seconds", "3", "--publish-every", "1", "--repeats", "1"],
    "predict": ["--scales", "1", "--rows", "300", "--train-steps", "5", "--repeats", "1"],
    "tabular": ["--seeds", "1", "--tables", "wine"],
    "quality": ["--tiny", "--tables", "wine,diabetes"],  # a classification and a regression table (each a batch run)
    "ids": ["--ids", "2000", "--dim", "4", "--batch", "64", "--steps", "2", "--touched", "0.1", "--repeats", "1",
            "--memory-ids", "2000", "--memory-workers", "2"],
    "ids-publish": ["--ids", "2000", "--dim", "4", "--touched", "0.1", "--repeats", "1"],
    "ids-auc": ["--events", "3000"],
    "features": ["--events", "3000", "--repeats", "1", "--keys", "2000", "--auc-events", "3000", "--stream-events",
                 "600", "--freshness-rate", "300", "--freshness-seconds", "1"],
}
#: The benches that take the session's broker instead of starting one.
ON_THE_SESSION_BROKER = ("kafka", "stream", "serve", "features")
#: A Markdown table: a header, its rule, a row.
TABLE = re.compile(r"^\|.*\|[ \t]*\n\|[-:| ]+\|[ \t]*\n\|.*\|[ \t]*$", re.M)
#: The benches of the two processes (every one but flink's).
IN_ONE_PROCESS = sorted(name for name in BENCHMARKS if name != "flink")
#: The benches of the second process (seconds of each on a quiet 2-core machine, 2026-12-07: 157 s in all, the
#: first process's 156 s); every other one, a new bench too, runs in the first.
SECOND_PROCESS = ("features", "serve", "dataparallel", "predict", "ids", "etl", "kafka", "loader", "ids-auc",
                  "ids-publish")
SMOKE_GROUPS = ("bench_smoke", "bench_smoke_2")
SMOKE_TIMEOUT_S = 900


def _group(name: str) -> str:
    return SMOKE_GROUPS[name in SECOND_PROCESS]


def _env(tmp: Path) -> dict:
    """The tiny preset as the default dataset, this checkout's bench/ importable, temporary files in the test's folder
    (benches that keep a fixed folder under the temp dir, e.g. tabular's, never meet another run's)."""
    (tmp / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "FLOWTRAIN_PRESETS": "tests.bench_preset", "TMPDIR": str(tmp / "tmp")}


def _run(benches: list[tuple[str, list[str]]], tmp: Path) -> dict:
    """``tests.bench_smoke_child`` on ``benches`` in ``tmp`` (their results written under it): its results."""
    spec, results = tmp / "spec.json", tmp / "results.json"
    spec.write_text(json.dumps([{"name": n, "args": a} for n, a in benches]))
    try:
        subprocess.run([sys.executable, "-m", "tests.bench_smoke_child", str(spec), str(results)], cwd=tmp,
                       env=_env(tmp), timeout=SMOKE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pass  # what finished is in the results; the bench in progress is named there
    return json.loads(results.read_text()) if results.exists() else {"running": benches[0][0], "benches": {}}


def _check(name: str, args: list[str], results: dict) -> None:
    args = " ".join(args)
    got = results["benches"].get(name)
    if got is None:
        stuck = results.get("running")
        pytest.fail(f"flowtrain bench {name} {args} did not run: the smoke process stopped "
                    f"{'in flowtrain bench ' + stuck if stuck else 'before it'} (timeout {SMOKE_TIMEOUT_S} s)")
    assert got["code"] == 0, f"flowtrain bench {name} {args} failed (exit {got['code']}):\n" \
                             f"{got['stdout'][-2000:]}\n{got['error'] or ''}"
    assert TABLE.search(got["stdout"]), f"flowtrain bench {name} {args} printed no table:\n{got['stdout'][-3000:]}"


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory, bootstrap, say):
    """``results(group)``: the benches of ``group`` at their tiny sizes, one after another in one process, run the
    first time a test of the group asks (once per worker: the tests of a group run on one worker)."""
    done: dict[str, dict] = {}

    def results(group: str) -> dict:
        if group not in done:
            tmp = tmp_path_factory.mktemp(group.replace("_", "-"))
            benches = [(n, TINY[n] + (["--bootstrap", bootstrap] if n in ON_THE_SESSION_BROKER else []))
                       for n in IN_ONE_PROCESS if n in TINY and _group(n) == group]
            done[group] = _run(benches, tmp)
            say(f"\n{group}: " + ", ".join(f"{n} {r['seconds']:.0f} s" for n, r in done[group]["benches"].items()))
        return done[group]

    return results


@pytest.mark.xdist_group("bench_smoke")
def test_every_bench_has_a_tiny_size():
    missing = sorted(set(BENCHMARKS) - set(TINY))
    # a tiny size for a name that is not a bench: `flowtrain bench NAME` would not run what the docs show
    assert not set(TINY) - set(BENCHMARKS), f"TINY names no bench: {sorted(set(TINY) - set(BENCHMARKS))}"
    assert not missing, (f"flowtrain bench {', '.join(missing)} has no tiny size in {Path(__file__).name}'s TINY: give "
                         f"it options for a run of seconds (a smoke run: it finishes and prints its table)")


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
@pytest.mark.kafka
@pytest.mark.streaming
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(_group(n)))
                                  for n in IN_ONE_PROCESS if n in TINY])
def test_bench_runs_at_a_tiny_size_and_prints_its_table(name, smoke_results):
    _check(name, TINY[name], smoke_results(_group(name)))


def test_the_second_process_names_only_benches():
    assert not set(SECOND_PROCESS) - set(IN_ONE_PROCESS), sorted(set(SECOND_PROCESS) - set(IN_ONE_PROCESS))


@pytest.mark.timeout(600)
@pytest.mark.xdist_group("flink")
@pytest.mark.flink
def test_bench_flink_runs_on_the_session_cluster_and_prints_its_table(flink_cluster, tmp_path):
    args = [*TINY["flink"], "--cluster-dir", str(flink_cluster.data_dir)]
    _check("flink", args, _run([("flink", args)], tmp_path))
