"""``flowtrain tune``'s SQLite study (``flowtrain.commands.tune.run.serialize_sqlite``): a waiting trial (a killed
trial's retry, enqueued) is taken by one thread only. Without it, Optuna's ``SELECT ... FOR UPDATE`` is a no-op on
SQLite and threads asking at once took the same trial (seen in CI: two trials of ``--parallel 2`` ran one retry
into one run directory; here 6 threads on 60 enqueued trials took 2-4 of them twice in every run without it). And a
new study file opened by several at once (``open_storage``): seen in CI, the tune process failed with ``UNIQUE
constraint failed: alembic_version`` while the test's reader created the same schema."""
from __future__ import annotations

import threading
from collections import Counter

import optuna
import pytest
from optuna.storages import RetryFailedTrialCallback
from optuna.trial import TrialState

from flowtrain.commands.tune.run import GRACE_BEATS, fail_dead_trials, open_storage, serialize_sqlite


def _at_once(fn, n: int, timeout: float) -> list[BaseException]:
    """``fn`` in ``n`` threads started together (a barrier); the errors they raised (the test's to name)."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run() -> None:
        start.wait()
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), f"a thread still runs after {timeout} s"
    return errors


@pytest.mark.timeout(120)
def test_threads_asking_at_once_never_take_the_same_waiting_trial(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}")
    serialize_sqlite(storage)
    study = optuna.create_study(storage=storage, study_name="s")
    for i in range(60):
        study.enqueue_trial({"x": float(i)})
    taken: Counter = Counter()

    def ask_ten() -> None:
        for _ in range(10):
            taken[study.ask().number] += 1

    errors = _at_once(ask_ten, 6, timeout=100)
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


@pytest.mark.timeout(120)
def test_a_new_storage_opened_by_several_at_once_opens_for_all(tmp_path):
    """Three threads open one new SQLite study file at the same moment, 15 times: every one gets the storage (with
    ``RDBStorage`` alone, 2 of the 3 failed in each round here: ``table studies already exists``)."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    errors: list[BaseException] = []
    for round_ in range(15):
        url = f"sqlite:///{tmp_path / f'study-{round_}.db'}"
        errors += _at_once(lambda url=url: optuna.create_study(storage=open_storage(url), study_name="s",
                                                                load_if_exists=True), 3, timeout=60)
    assert not errors, errors[:3]


@pytest.mark.timeout(60)
def test_a_running_trial_without_a_heartbeat_row_is_failed_and_retried_on_resume(tmp_path, capsys):
    """The study killed while a trial's first heartbeat waited for the file's lock (seen in CI): the trial is running
    with no heartbeat row, which Optuna's stale check skips for ever. On resume it is failed after the grace period
    and enqueued again with its parameters; a trial that beats on meanwhile (another live process) stays running."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1, grace_period=GRACE_BEATS,
                           heartbeat_stale_trial_callback=RetryFailedTrialCallback(max_retry=3))
    serialize_sqlite(storage)
    study = optuna.create_study(storage=storage, study_name="s")
    dead, live = study.ask(), study.ask()
    dead.suggest_float("x", 0.0, 1.0)
    beating, stop = threading.Thread(target=lambda: _beat(storage, live._trial_id, stop)), threading.Event()
    beating.start()
    try:
        fail_dead_trials(study, storage, heartbeat=1)
    finally:
        stop.set()
        beating.join(timeout=10)
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert states[dead.number] == TrialState.FAIL and states[live.number] == TrialState.RUNNING
    retry = [t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
    assert [t.params for t in retry] == [dead.params]
    assert f"trial(s) {dead.number} of an earlier run stopped without finishing" in capsys.readouterr().out


def _beat(storage, trial_id: int, stop: threading.Event) -> None:
    while not stop.wait(0.3):
        storage.record_heartbeat(trial_id)
