"""What a benchmark streams or scores: the demo (the default dataset preset), or a table of your own (``--input`` with its spec, or
``--dataset``): ``Table``, and the options that name it (``add_table_options``, ``table_from_options``)."""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.demo import build_demo, demo


class Table:
    """What the bench streams: the demo (``input`` None) or ``--input`` files with a spec."""

    def __init__(self, input: list[str] | None = None, dataset: str | None = None, spec: dict | None = None):
        self.input, self.dataset, self.spec = input, dataset, spec

    def make_dataset(self, work: Path) -> str:
        from flowtrain.local.runners import pipeline_options

        if self.dataset:
            return self.dataset
        if self.input:
            from connectors.dataset_spec import FeatureSpec
            from pipelines.tabular.pipeline import run_tabular_etl

            run_tabular_etl(self.input, FeatureSpec(**self.spec), dataset_path=str(work / "ds"),
                            dead_letters_path=None, options=pipeline_options("batch"))
            return str(work / "ds")
        build_demo(demo(), "", dataset_path=work / "ds", options=pipeline_options("batch"))
        return str(work / "ds")

    def replay_args(self, dataset: str) -> list[str]:
        if not self.input:
            return []
        # file order, stamped when sent: the latencies are measured from the Kafka timestamps
        return [a for path in self.input for a in ("--input", path)] + ["--dataset", dataset]

    def rows(self) -> int | None:
        if not self.input:
            return None
        from pipelines.stream.replay import read_files

        return read_files(self.input).num_rows


def add_table_options(ap: argparse.ArgumentParser, input_help: str) -> None:
    """``--input FILE`` and its spec (or ``--dataset``): the benchmark on a table of your own."""
    g = ap.add_argument_group("your own table (default: the demo dataset)")
    g.add_argument("--input", action="append", default=None, help=input_help)
    g.add_argument("--dataset", default=None, help="its `flowtrain batch` dataset (else the ETL below makes one)")
    g.add_argument("--label", help="label column")
    g.add_argument("--task", choices=["classification", "regression"], default=None)
    g.add_argument("--numeric", default="", help="numeric columns, comma-separated")
    g.add_argument("--optional-numeric", default="", help="numeric columns that may be missing")
    g.add_argument("--categorical", default="", help="categorical columns")
    g.add_argument("--time-column", default=None, help="time column (the events' order and Kafka timestamps)")


def table_from_options(ap: argparse.ArgumentParser, a: argparse.Namespace) -> Table | None:
    """The :class:`Table` that ``add_table_options``' options name; None: the demo."""
    if not a.input:
        return None
    if not a.dataset and not a.label:
        ap.error("--input needs --dataset DIR, or the spec (--label and the feature columns) for the ETL")
    cols = {k: [c for c in getattr(a, k).split(",") if c] for k in ("numeric", "optional_numeric", "categorical")}
    spec = {"label": a.label, "task": a.task, "time_column": a.time_column, **cols} if not a.dataset else None
    if spec and spec["task"] is None:
        from pipelines.tabular.preflight import file_head, infer_task

        spec["task"] = infer_task(a.label, file_head(a.input[0]))[0]
    return Table(a.input, a.dataset, spec)
