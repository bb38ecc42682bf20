"""``flowtrain tune``'s SQLite study (``flowtrain.commands.tune_run.serialize_sqlite``): a waiting trial (a killed
trial's retry, enqueued) is taken by one thread only. Without it, Optuna's ``SELECT ... FOR UPDATE`` is a no-op on
SQLite and threads asking at once took the same trial (seen in CI: two trials of ``--parallel 2`` ran one retry
into one run directory; here 6 threads on 60 enqueued trials took 2-4 of them twice in every run without it)."""
from __future__ import annotations

import threading
from collections import Counter

import optuna
import pytest

from flowtrain.commands.tune_run import serialize_sqlite


@pytest.mark.timeout(120)
def test_threads_asking_at_once_never_take_the_same_waiting_trial(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}")
    serialize_sqlite(storage)
    study = optuna.create_study(storage=storage, study_name="s")
    for i in range(60):
        study.enqueue_trial({"x": float(i)})
    taken: Counter = Counter()
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def ask_ten() -> None:
        start.wait()
        try:
            for _ in range(10):
                taken[study.ask().number] += 1
        except BaseException as err:  # noqa: BLE001 - a thread's error is the test's, named below
            errors.append(err)

    threads = [threading.Thread(target=ask_ten) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not errors, errors  # e.g. "database is locked": the lock wait ran out
    assert sum(taken.values()) == 60
    assert {n: k for n, k in taken.items() if k > 1} == {}
    assert sorted(taken) == list(range(60))  # the enqueued trials, each once: none made anew


def test_an_in_memory_study_is_left_as_it_is():
    """``--storage sqlite://`` (in memory): one connection holds the study; it is not serialized nor disposed."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = optuna.storages.RDBStorage("sqlite://")
    serialize_sqlite(storage)
    study = optuna.create_study(storage=storage, study_name="s")
    trial = study.ask()
    study.tell(trial, 1.0)
    assert [t.value for t in study.get_trials(deepcopy=False)] == [1.0]
