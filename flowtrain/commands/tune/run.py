"""The study of ``flowtrain tune`` (``flowtrain.commands.tune.options``'s module doc): the dataset once, the Optuna study in its
storage, trials in their own processes (``flowtrain.commands.tune.trial``), the report (``tune.report``).
Imported when a study runs: Optuna is ``flowtrain[tune]``'s."""
from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path

import optuna
from optuna.storages import RDBStorage, RetryFailedTrialCallback, fail_stale_trials
from optuna.trial import TrialState
from sqlalchemy import event
from sqlalchemy.exc import IntegrityError, OperationalError

from connectors.fields import OptionError, check, options_of, to_config
from flowtrain.commands.batch.etl import build_dataset
from flowtrain.commands.batch.options import BatchJob, BatchWorkers
from flowtrain.commands.tracking_options import check_tracking
from flowtrain.commands.tune.options import TuneJob
from flowtrain.commands.tune.report import write_tune_report
from flowtrain.commands.tune.space import OWNED, batch_options, default_space, parse_space
from flowtrain.commands.tune.trial import TrialRunner
from flowtrain.errors import FlowtrainError
from flowtrain.train.loader import TabularDataset
from flowtrain.train.metrics import SELECT_BY, check_select_by
from flowtrain.train.options import ParallelOptions, TrainOptions

#: How many heartbeats (``--heartbeat``) a trial may miss before it counts as dead.
GRACE_BEATS = 4
#: Seconds an SQLite transaction waits for the study file's lock (heartbeats, reports and pops of trials at once).
SQLITE_LOCK_WAIT_S = 60


#: Tries at opening a storage whose schema another process may be creating at the same moment.
OPEN_TRIES = 6


def open_storage(url: str, **options) -> RDBStorage:
    """Optuna's ``RDBStorage(url, **options)``, its schema created if new. Two processes (two ``flowtrain tune`` on one
    ``--storage``, or a tune and a reader of its study) opening one new database at once both create its tables and
    insert its schema version, and one fails (``table studies already exists``, ``UNIQUE constraint failed:
    alembic_version``): that one tries again, and finds the other's schema. Any other error, or the same one
    ``OPEN_TRIES`` times, is raised."""
    for attempt in range(OPEN_TRIES):
        try:
            return RDBStorage(url, **options)
        except (IntegrityError, OperationalError) as err:
            text = str(err)
            racing = "already exists" in text or "alembic_version" in text or "database is locked" in text
            if not racing or attempt == OPEN_TRIES - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def serialize_sqlite(storage: RDBStorage) -> None:
    """An SQLite study: every transaction ``BEGIN IMMEDIATE`` (SQLAlchemy's pysqlite recipe), so a trial's read and
    update are one step. Optuna takes a waiting trial (an enqueued retry) by reading it WAITING and setting it RUNNING
    with ``SELECT ... FOR UPDATE``, which SQLite ignores: two threads of ``--parallel`` (or two processes on the same
    file) both took the same retry and ran it into the same run directory (seen: the second run refused, the trial
    marked failed, the first one's reports then refused). Other databases lock the row and are left as they are; so
    is an in-memory SQLite study (one connection, which ``dispose`` would close with the study in it)."""
    engine = storage.engine
    if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
        return

    @event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # pysqlite's own BEGIN off: the one below is the transaction's
        dbapi_connection.execute(f"PRAGMA busy_timeout = {SQLITE_LOCK_WAIT_S * 1000}")

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # the connections made before the listeners: closed, new ones get them


def _fixed_flags(job: TuneJob, searched: set[str]) -> list[str]:
    """The training, parallelism and worker options the job gives (not the defaults, not what is searched), as
    flags every trial repeats."""
    defaults = BatchJob()
    flags: list[str] = []
    for opt in (*options_of(TrainOptions), *options_of(ParallelOptions), *options_of(BatchWorkers)):
        if opt.name in searched or opt.name in OWNED or opt.name == "no_progress":
            continue
        value = getattr(job, opt.name)
        if value is None or value == getattr(defaults, opt.name):
            continue
        if opt.parse is None:
            flags.append(opt.flag) if value else None
        else:
            flags += [opt.flag, ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)]
    return flags


def _dataset(job: TuneJob, out: Path) -> Path:
    """The study's one dataset: ``--dataset``, the one a resumed study built, or the batch ETL's now."""
    batch = BatchJob(**{o.name: getattr(job, o.name) for o in options_of(BatchJob)})
    batch = dataclasses.replace(batch, out=str(out))
    path, _ = build_dataset(batch, out, resume=(out / "dataset" / "_manifest.json").exists())
    return path


def _direction(metric: str) -> str:
    return "maximize" if SELECT_BY[metric] else "minimize"


def run_tune(job: TuneJob) -> dict:
    """The whole study; returns its summary (also in ``<out>/best.json``). A user's error is a one-line
    ``FlowtrainError``."""
    return run_study(job)


def run_study(job: TuneJob) -> dict:
    """``flowtrain tune``'s study (``run_tune``)."""
    job = check(job)
    check_tracking(job)
    if job.job_only or job.print_plan or job.resume or job.overwrite:
        raise FlowtrainError("flowtrain tune: --job-only, --print-plan, --resume and --overwrite are batch's; a "
                             "study resumes by itself (the same --out / --storage)")
    out = Path(job.out or f"runs/tune-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    options = batch_options()
    try:
        space = parse_space(job.search, options) if job.search else None
    except OptionError as err:
        raise FlowtrainError(str(err)) from None
    dataset = _dataset(job, out)
    data = TabularDataset(dataset)
    try:
        metric = check_select_by(job.select_by, data.kind)
    except ValueError as err:
        raise FlowtrainError(str(err)) from None
    space = space or default_space(data.kind)
    fixed = _fixed_flags(job, {d.name for d in space} | ({"hidden"} if {"width", "depth"} & {d.name for d in space}
                                                          else set()))
    storage_url = job.storage or f"sqlite:///{out / 'study.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeats: Optuna's own
    try:
        storage = open_storage(storage_url, heartbeat_interval=job.heartbeat,
                               grace_period=GRACE_BEATS * job.heartbeat,
                               heartbeat_stale_trial_callback=RetryFailedTrialCallback(max_retry=3))
    except Exception as err:  # noqa: BLE001 - SQLAlchemy's errors: named, one line
        raise FlowtrainError(f"--storage {storage_url}: {str(err).splitlines()[0]}") from None
    serialize_sqlite(storage)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=5) if job.pruner == "median" else optuna.pruners.NopPruner()
    study = optuna.create_study(storage=storage, study_name=job.study_name, direction=_direction(metric),
                                sampler=optuna.samplers.TPESampler(seed=job.seed), pruner=pruner, load_if_exists=True)
    study.set_user_attr("metric", metric)
    fail_dead_trials(study, storage, job.heartbeat)
    finished = _finished(study)
    print(f"tune: study {job.study_name!r} in {storage_url}: {len(finished)} of {job.trials} trial(s) finished; "
          f"optimizing validation {metric} ({study.direction.name.lower()}) over "
          + ", ".join(f"{d.name}={d.text()}" for d in space), flush=True)
    env, tracking = {}, None
    if job.mlflow:  # the study is a run, each trial its child (flowtrain[mlflow])
        from flowtrain.commands import mlflow_tracking as tracking

        parent = tracking.start_study(job.mlflow, job.mlflow_experiment, f"tune-{job.study_name}",
                                      {"trials": job.trials, "metric": metric, "dataset": str(dataset),
                                       **{f"space_{d.name}": d.text() for d in space}})
        env = {tracking.PARENT_ENV: parent}
        fixed += ["--mlflow", job.mlflow, "--mlflow-experiment", job.mlflow_experiment]
    runner = TrialRunner(out=out, dataset=dataset, study=job.study_name, metric=metric, space=space, fixed=fixed,
                         options=options, timeout=job.trial_timeout, env=env)
    _optimize(study, runner, job)
    summary = write_tune_report(study, out, space=space, metric=metric, config=to_config(job))
    if tracking is not None:
        tracking.log_study(job.mlflow, env[tracking.PARENT_ENV], out, summary, model_name=job.mlflow_model,
                           experiment=job.mlflow_experiment)
    if summary.get("best"):
        b = summary["best"]
        print(f"tune: best trial {b['number']}: validation {metric} {b['value']:.4f} ({b['params']}); "
              f"run {b['run_dir']}, bundle {b['run_dir']}/bundle", flush=True)
    print(f"tune: report {out / 'tune_report.md'}", flush=True)
    return summary


def _optimize(study, runner: TrialRunner, job: TuneJob) -> None:
    """Trials until the study has ``--trials`` finished ones (a failed trial does not count: another one runs),
    ``--timeout`` passes, or as many trials failed in a row as were asked for (a space that cannot train)."""
    stop = optuna.study.MaxTrialsCallback(job.trials, states=(TrialState.COMPLETE, TrialState.PRUNED))
    started, failures = time.monotonic(), 0
    while failures < job.trials:
        remaining = job.trials - len(_finished(study))
        left = None if job.timeout is None else job.timeout - (time.monotonic() - started)
        if remaining <= 0 or (left is not None and left <= 0):
            return
        before = len(study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
        study.optimize(runner, n_trials=remaining, timeout=left, n_jobs=job.parallel, callbacks=[stop],
                       catch=(FlowtrainError,), gc_after_trial=False)
        failed = len(study.get_trials(deepcopy=False, states=(TrialState.FAIL,))) - before
        failures = failures + failed if failed else 0
    print(f"tune: {failures} trial(s) failed in a row; stopping (see their logs under {runner.out / 'trials'})",
          flush=True)


def _finished(study) -> list:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))


def fail_dead_trials(study, storage: RDBStorage, heartbeat: int) -> None:
    """Trials left running by a process that is gone (their heartbeat stopped, e.g. after ``kill -9``): wait out
    the grace period, then mark them failed; the retry callback enqueues each again with its parameters. A trial
    whose heartbeat goes on (another live process on the same storage) stays running."""
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if not running:
        return
    fail_stale_trials(study)  # those whose last beat is older than the grace period: failed now
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # Optuna never fails a running trial without a heartbeat row (seen in CI: the study killed while a trial's
        # first beat waited for the file's lock, and that trial stayed running on resume). One beat now for each
        # still running: a dead one is stale after the grace period, a live one beats on.
        storage.record_heartbeat(trial._trial_id)  # FrozenTrial's id: Optuna names it so
    deadline = time.monotonic() + (GRACE_BEATS + 2) * heartbeat
    while True:
        fail_stale_trials(study)
        still = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not still or time.monotonic() > deadline:
            break
        time.sleep(1)
    failed = sorted({t.number for t in running} - {t.number for t in still})
    if failed:
        print(f"tune: trial(s) {', '.join(map(str, failed))} of an earlier run stopped without finishing (no "
              f"heartbeat for {GRACE_BEATS * heartbeat} s): marked failed, retried with their parameters", flush=True)


