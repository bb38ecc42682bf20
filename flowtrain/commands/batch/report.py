"""The batch job's last step, after training: the model and its baselines on the test split, the evaluation
(intervals, curves, thresholds, importance, slices), the figures, TensorBoard's test metrics, ``summary.json``,
``report.md``/``report.html``, the drift reference and the bundle (``flowtrain.commands.batch.job`` runs it)."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from connectors.dataset_spec import positive_class_of
from flowtrain.commands.drift.job import REFERENCE, write_reference
from flowtrain.observe.board import write_batch_results
from flowtrain.train.bundle import write_bundle
from flowtrain.train.class_weights import class_weights_of
from flowtrain.train.evaluation import evaluate_run
from flowtrain.train.figures import plot_confusion, plot_curves, plot_evaluation
from flowtrain.train.loader import TabularDataset, target_scale
from flowtrain.train.loop import baseline_metrics, evaluate
from flowtrain.train.metrics import SELECT_BY, MetricsLog, standard_error
from flowtrain.train.model_choice import model_choice
from flowtrain.train.report import describe_data, write_report, write_summary
from flowtrain.train.rundir.files import RunFiles
from flowtrain.train.shards import open_split


def report_run(run_dir: Path, data: TabularDataset, *, title: str, dataset_path: Path, config, model, linear,
               fitted: dict, training: dict, workers: int, slice_by: str | None, factory: str | None,
               bundle_key: bytes | None, t0: float) -> dict:
    """Evaluate the trained ``model`` (``fitted``: fit.json's record, ``training``: training.json's) next to
    its baselines (``linear``: the fitted linear baseline), write the run's report, figures and bundle; return
    the summary (also in summary.json)."""
    test = open_split(data, "test", memory_budget=config.memory_budget)
    majority = "majority class" if data.spec.task == "classification" else "training mean"
    scale, classes = target_scale(data), data.classes
    weights = class_weights_of(config, data)  # --class-weight: the weighted test metrics too
    fitted = dict(fitted)
    summary = {
        "title": title,
        "run_dir": str(run_dir),
        "task": data.spec.task,
        "target": data.manifest.get("target", data.spec.label),
        "dataset": str(dataset_path),
        "rows": data.manifest["rows"],
        "counts": data.manifest["counts"],
        "data": describe_data(data.manifest),  # columns used and unused, the split's boundaries as dates
        "kind": data.kind,
        "classes": classes,
        "positive_class": positive_class_of(data.spec, data.stats),  # binary: the class probabilities are of
        "select_by": training.get("select_by"),
        "test": {"model": evaluate(model, test, data.spec.task, scale, classes, weights),
                 "baselines": {majority: baseline_metrics(data, test),
                               "linear model": evaluate(linear.model, test, data.spec.task, scale, classes, weights)}},
        "valid_best": fitted.pop("best_valid"),
        "training": {**fitted, "workers": workers, "best_step": training.get("best_step"),
                     "plan": training.get("plan"), "memory": training.get("memory")},
        "linear": {"method": "L-BFGS, full batch, float64", "iterations": linear.iterations,
                   "grad_norm": linear.grad_norm, "l2": linear.l2, "seconds": linear.seconds},
        "wall_seconds": time.perf_counter() - t0,
    }
    history = MetricsLog(RunFiles(run_dir).metrics).read()
    metric = summary["select_by"] or "loss"
    summary["model_choice"] = model_choice(
        metric=metric, higher=SELECT_BY[metric], standard_error=standard_error, best_step=training.get("best_step"),
        history=history,
        valid_rows=int(summary["rows"]["valid"]), test_model=summary["test"]["model"],
        test_linear=summary["test"]["baselines"]["linear model"],
        architecture=f"your model {factory}" if factory else model.describe() if hasattr(model, "describe")
        else type(model).__name__, parameters=sum(p.numel() for p in model.parameters()))
    # the evaluation (intervals, curves, thresholds, importance, slices), TensorBoard's test metrics
    evaluation = evaluate_run(data, {"flowtrain model": model, "linear model": linear.model}, test,
                              open_split(data, "valid", memory_budget=config.memory_budget), majority=majority,
                              select_by=summary["select_by"], scale=scale, slice_by=slice_by, seed=config.seed)
    summary["evaluation"] = evaluation.summary
    plot_curves(history, run_dir, task=data.spec.task, metric=summary["select_by"], valid_rows=summary["rows"]["valid"])
    if data.kind == "multiclass":
        plot_confusion(run_dir, summary["test"]["model"]["confusion"], classes)
    plot_evaluation(run_dir, evaluation)
    write_batch_results(run_dir, step=int(fitted["steps"]), hparams={**dataclasses.asdict(config), "workers": workers},
                        test={k: m["value"] for k, m in evaluation.summary["intervals"]["models"]["flowtrain model"]
                              .items()},
                        **({"labels": evaluation.y, "probabilities": evaluation.predictions["flowtrain model"]}
                           if data.kind == "binary" else {}))
    summary["wall_seconds"] = time.perf_counter() - t0
    write_summary(run_dir, summary)
    write_report(run_dir, summary, history)
    reference = write_reference(run_dir, data, model)  # what `flowtrain drift`, predict and the scorer compare with
    write_bundle(RunFiles(run_dir).bundle, model, data, config, factory=factory, run=run_dir.name, key=bundle_key,
                 extra={REFERENCE: reference})
    return summary
