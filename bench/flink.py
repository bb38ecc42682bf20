"""bench flink: the demo dataset's batch ETL on Apache Flink (1 and 2 TaskManagers) vs the FnApiRunner and a
plain pyarrow script (the anchor), at 1x and 10x the demo's rows.

The demo is the default dataset preset (``pipelines.presets``): its ``build`` (the Beam ETL), its ``anchor``
(the same ETL as one pyarrow script) and, for 10x, its ``scale`` hook (the demo's: the year repeated with
shifted dates and tail numbers). Two local session clusters run side by side for the whole run
(``LocalFlink`` with 1 and with 2 TaskManagers, one slot each, so a job's parallelism is the
TaskManager count; TaskManager memory sized for the 10x reference tables); every pipeline on them is a real Flink job (Beam's job server, Python SDK
workers from flowtrain's worker pool). Cases are interleaved (every engine and scale once per
repeat) after an untimed warm-up job per engine; each cell is the median of the repeats.

Also reported: the start-up of each cluster, and the fixed cost of one job (a one-element
pipeline), which is most of what Flink adds on a small input.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.demo import demo, event_rows, hook, scaled_inputs
from bench.table import report
from flowtrain.local.tools import free_port

SCALES = (1, 10)
ENGINES = ("pyarrow", "fnapi", "flink-1tm", "flink-2tm")
NAMES = {"pyarrow": "plain pyarrow script (anchor)", "fnapi": "Beam FnApiRunner",
         "flink-1tm": "Beam on Flink, 1 TaskManager", "flink-2tm": "Beam on Flink, 2 TaskManagers"}


class _Clusters:
    """A Flink cluster per TaskManager count, started once, stopped at the end; or (``cluster_dir``) the running
    local cluster recorded there, used as it is and left running."""

    def __init__(self, work: Path, cluster_dir: str | None = None):
        from flowtrain.local.flink import LocalFlink, TaskManagerMemory

        self.start_s: dict[int, float] = {}
        self.own = cluster_dir is None
        if not self.own:
            cluster = LocalFlink(data_dir=Path(cluster_dir))
            state = cluster.read_state()
            if not cluster.running() or not state:
                raise SystemExit(f"bench flink: --cluster-dir {cluster_dir}: no local Flink cluster is running there "
                                 f"(start one with `flowtrain flink start`)")
            self.clusters = {int(state["taskmanagers"]): cluster}
            return

        # Sized for 10x: the reference tables are one 23 MB broadcast record (see TaskManagerMemory),
        # and one TaskManager alone buffers the whole join's output from the Python workers
        # (1 GiB of task heap ran out there; 2 GiB did not).
        memory = TaskManagerMemory(task_heap=2048, managed=768, task_off_heap=768)
        self.clusters = {n: LocalFlink(taskmanagers=n, slots=1, rest_port=free_port(), job_port=free_port(),
                                       data_dir=work / f"flink-{n}tm", memory=memory) for n in (1, 2)}

    def __enter__(self):
        if not self.own:
            return self
        try:
            for n, cluster in self.clusters.items():
                self.start_s[n] = cluster.start(timeout_s=300, quiet=True)["start_seconds"]
                print(f"bench flink: cluster with {n} TaskManager(s) up in {self.start_s[n]:.1f} s", flush=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        if not self.own:
            return
        for cluster in self.clusters.values():
            cluster.stop(quiet=True)

    def options(self, taskmanagers: int):
        from apache_beam.options.pipeline_options import PipelineOptions

        return PipelineOptions(self.clusters[taskmanagers].beam_args())


def _engines(clusters: _Clusters) -> tuple[str, ...]:
    """The anchor, the FnApiRunner and Beam on each cluster (``flink-Ntm``: the cluster of N TaskManagers)."""
    return ("pyarrow", "fnapi", *(f"flink-{n}tm" for n in sorted(clusters.clusters)))


def _etl(engine: str, tables: dict[str, str], spec, out: Path, clusters: _Clusters) -> float:
    """Seconds for one ETL run of ``engine`` (its output removed afterwards)."""
    from flowtrain.local.runners import pipeline_options

    preset = demo()
    anchor, build = hook(preset, "anchor", "flink"), hook(preset, "build", "flink")
    t0 = time.perf_counter()
    try:
        if engine == "pyarrow":
            anchor(tables, out, spec)
        else:  # the preset's own build (not build_dataset, which also rewrites the manifest): the ETL alone
            options = pipeline_options("batch") if engine == "fnapi" else \
                clusters.options(int(engine.removeprefix("flink-").removesuffix("tm")))
            build(tables, dataset_path=str(out), dead_letters_path=str(out) + "-dead.jsonl", options=options,
                  spec=spec)
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
        Path(str(out) + "-dead.jsonl").unlink(missing_ok=True)


def _empty_job(clusters: _Clusters, taskmanagers: int) -> float:
    import apache_beam as beam

    t0 = time.perf_counter()
    with beam.Pipeline(options=clusters.options(taskmanagers)) as p:
        _ = p | beam.Create([1]) | beam.Map(lambda x: x)
    return time.perf_counter() - t0


def run(*, scales=SCALES, repeats: int = 3, out_dir: str | None = "bench/results", cluster_dir: str | None = None,
        warmup: bool = True) -> str:
    """``cluster_dir``: run on the local cluster running there (``flowtrain flink start``) instead of starting one
    of 1 and one of 2 TaskManagers; ``warmup``: one untimed ETL per engine first."""
    preset = demo()
    for name in ("build", "anchor"):  # a missing hook says so before the clusters start
        hook(preset, name, "flink")
    inputs = {s: scaled_inputs(preset, s, "flink") for s in scales}
    rows = {s: event_rows(preset, inputs[s][0], "flink") for s in scales}
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-flink-"))
    ok = False
    try:
        with _Clusters(work, cluster_dir) as clusters:
            engines = _engines(clusters)
            seconds: dict[tuple[str, int], list[float]] = {(e, s): [] for s in scales for e in engines}
            for engine in engines[1:] if warmup else ():  # warm-up: imports, JIT, SDK workers; untimed
                _etl(engine, *inputs[scales[0]], work / f"warm-{engine}", clusters)
            job_s = {n: statistics.median(_empty_job(clusters, n) for _ in range(min(3, repeats)))
                     for n in clusters.clusters}
            for r in range(repeats):
                for s in scales:
                    for engine in engines:
                        took = _etl(engine, *inputs[s], work / f"{engine}-{s}x-{r}", clusters)
                        seconds[(engine, s)].append(took)
                        print(f"bench flink: repeat {r + 1}/{repeats} {s}x {engine}: {took:.1f} s", flush=True)
        ok = True
    finally:
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"bench flink: failed; the clusters' logs are kept in {work}", flush=True)
    table = []
    for s in scales:
        anchor = rows[s] / statistics.median(seconds[("pyarrow", s)])
        for engine in engines:
            sec = statistics.median(seconds[(engine, s)])
            name = NAMES.get(engine) or f"Beam on Flink, {engine.removeprefix('flink-').removesuffix('tm')} TaskManagers"
            table.append((name, f"{s}x", f"{rows[s]:,}", sec, rows[s] / sec, rows[s] / sec / anchor))
    for n in sorted(clusters.clusters):
        table.append((f"Flink cluster start, {n} TaskManager(s)", "-", "-",
                      clusters.start_s[n] if n in clusters.start_s else "already running", "-", "-"))
        table.append((f"one-element job on Flink, {n} TaskManager(s)", "-", "1", job_s[n], "-", "-"))
    how = f"median of {repeats} interleaved runs" if repeats >= 3 else \
        f"median of only {repeats} run(s) (fewer than 3: indicative)"
    return report("flink", ["ETL", "scale", "rows", f"seconds ({how})", "rows/s", "vs pyarrow"], table,
                  notes=["Same joins, checks, date split, statistics, features and Parquet output in every case. "
                         "Flink runs include job submission, translation and SDK worker start-up; local clusters "
                         "(Flink 1.19, Beam runner 2.62, Python SDK 2.77) on the same 2 cores as everything else."],
                  out_dir=out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="flowtrain bench flink", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per case (default 3)")
    ap.add_argument("--scales", default=",".join(map(str, SCALES)), help="row multiples (default 1,10)")
    ap.add_argument("--cluster-dir", default=None, help="run on the local cluster running in this directory "
                    "(`flowtrain flink start`) instead of starting one of 1 and one of 2 TaskManagers")
    ap.add_argument("--no-warmup", action="store_true", help="no untimed ETL per engine first (the first timed run "
                    "pays the imports and the SDK workers' start)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    run(scales=tuple(int(s) for s in args.scales.split(",")), repeats=args.repeats, cluster_dir=args.cluster_dir,
        warmup=not args.no_warmup)


if __name__ == "__main__":
    main()
