"""``flowtrain bench NAME``: run one benchmark (or all) and print its table of ratios."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

#: benchmark name -> (module under bench/, one-line description)
BENCHMARKS = {
    "kafka": ("bench.kafka", "ReadFromKafka per record, batched, confluent vs raw kafka-python and confluent loops"),
    "etl": ("bench.etl", "flights ETL on Beam vs a plain pyarrow script at 1x/10x (--scales 1,10,30): rows/s, peak RSS"),
    "loader": ("bench.loader", "columnar loader vs torch DataLoader over the same Parquet files"),
    "train-scale": ("bench.train_scale", "one epoch at 1x/10x data: streamed shards vs in memory, rows/s, RSS"),
    "dataparallel": ("bench.dataparallel", "map/reduce data parallelism vs DistributedDataParallel"),
    "pipeline": ("bench.pipeline", "GPipe/1F1B stages vs torch.distributed.pipelining, bubbles, memory"),
    "tensor": ("bench.tensor", "column/row-parallel MLP (T = 2) vs DTensor parallelize_module, bytes, memory"),
    "memory": ("bench.memory", "per-rank bytes and step time, ZeRO-1/2/3 (--shard-states) vs FSDP2 fully_shard, "
                               "N = 1, 2, 4; PP/TP per-rank bytes planned"),
    "stream": ("bench.stream", "streaming job throughput, produce-to-model latency, trainer consume rate"),
    "flink": ("bench.flink", "flights ETL on Flink (1 and 2 TaskManagers) vs FnApiRunner vs pyarrow, 1x/10x rows"),
    "serve": ("bench.serve", "scoring pipeline (RunInference) vs a PyTorch loop, produce-to-prediction latency, "
                             "model freshness"),
    "predict": ("bench.predict", "flowtrain predict (Beam RunInference) vs pyarrow batches + the bundle's predict, "
                                 "1x/10x flights rows/s"),
    "tabular": ("bench.tabular", "flowtrain batch on public tables vs scikit-learn linear models and HGB"),
    "quality": ("bench.quality", "the default model vs its linear start, HGB and LightGBM on 9 offline tables"),
    "ids": ("bench.ids", "ID tables (flowtrain.train.ids) vs torch.nn.EmbeddingBag: lookups/s, rows trained/s; "
                         "bytes of a snapshot and a 1%-touched delta of a 1,000,000-ID table"),
    "ids-publish": ("bench.ids_publish", "bytes and seconds per published version with an ID table: a delta (1% of "
                                         "1,000,000 rows touched) vs a snapshot vs the whole checkpoint"),
    "features": ("bench.features", "features over time: backfill vs pandas/DuckDB, state bytes, AUC, the stream"),
    "ids-auc": ("bench.ids_auc", "new users on a click stream: ID tables vs a fixed vocabulary and the hashing "
                                 "trick at the same memory, AUC overall and on new users' first events"),
}


def _checkout_on_path() -> None:
    """``bench/`` is not installed: it is found in the source checkout the command runs in (its root as the
    working directory), which a console script does not put on ``sys.path`` by itself."""
    cwd = Path.cwd()
    if (cwd / "bench" / "__init__.py").is_file() and str(cwd) not in sys.path:
        sys.path.insert(0, str(cwd))


def _run(args: argparse.Namespace) -> int:
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    _checkout_on_path()
    for name in names:
        try:
            module = importlib.import_module(BENCHMARKS[name][0])
        except ModuleNotFoundError as err:
            if err.name not in ("bench", BENCHMARKS[name][0]):
                raise
            print("flowtrain bench: the benchmarks live in the source repository's bench/ folder, which is not "
                  "installed: run this command from a checkout of flowtrain (its root as the working directory)",
                  file=sys.stderr)
            return 2
        module.main(args.rest)
    return 0


def register(sub) -> None:
    lines = "\n".join(f"  {name:<14}{desc}" for name, (_, desc) in BENCHMARKS.items())
    parser = sub.add_parser(
        "bench", help="run a benchmark against its anchor and print the table",
        description=f"Benchmarks, each measured against its anchor in the same run:\n{lines}\n"
                    "Options after NAME go to the benchmark (e.g. flowtrain bench kafka --records 400000).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=[*BENCHMARKS, "all"], help="which benchmark")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options for the benchmark")
    parser.set_defaults(func=_run)
