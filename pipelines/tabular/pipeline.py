"""The generic tabular ETL as Beam transforms: validate, split, full-pass statistics, featurize.

    files -> ReadFromFiles(with_source) -> ValidateRows --errs--> dead letters
                                              |
                                         AssignSplits -> (split, batch)
                                              |--train--> ComputeStats (one full pass)
                                         WriteToSpill (temporary files; only their names go on)
                                              |
                                         ReadFromSpill -> Featurize(stats as side input) -> WriteDataset

Counts reconcile and go into the manifest: rows in = rows out (all splits) + dead letters.
"""
from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from connectors.dataset import WriteDataset, read_manifest
from connectors.dataset_spec import ID_PREFIX, SPLITS, FeatureSpec
from connectors.deadletter import ERRS, PARTS_SUFFIX, WriteDeadLettersToJsonl, reason_kind
from connectors.files import MAX_RECORD_BYTES, ReadFromFiles
from connectors.id_keys import reason_counts
from connectors.paths import origin_of
from connectors.spill import SPILL_SUFFIX, ReadFromSpill, WriteToSpill, remove_spill, spill_directory
from pipelines.tabular.checks import split_valid
from pipelines.tabular.features import featurize_rows
from pipelines.tabular.preflight import check_splits, expand_inputs, preflight, resolve_task
from pipelines.tabular.schema import read_types
from pipelines.tabular.splits import assign_splits, source_names
from pipelines.tabular.stats import StatsAccumulator
from pipelines.tabular.times import time_cutoff, time_seconds

ExtraChecks = Callable[[pa.RecordBatch], list]


# ---------------------------------------------------------------------------------------------
# Beam steps
# ---------------------------------------------------------------------------------------------
#: Beam metrics of the ETL (``PipelineResult.metrics()``, the runner's UI): counters ``rows_in``
#: (rows read, the reader's dead letters included), ``bytes_read`` (Arrow bytes of the rows read),
#: ``rows_out`` and ``rows_out: <split>``, ``dead_letters`` and ``dead_letters: <kind>`` (``reason_kind``);
#: distributions ``validate_ms`` and ``featurize_ms`` (per record batch).
METRICS_NAMESPACE = "flowtrain.etl"


def _count_dead(letter) -> tuple[str, int]:
    """Counted by kind (``reason_kind``: ``malformed JSON line``, not one count per error position)."""
    kind = reason_kind(letter.reason)
    Metrics.counter(METRICS_NAMESPACE, "dead_letters").inc()
    Metrics.counter(METRICS_NAMESPACE, f"dead_letters: {kind}").inc()
    return kind, 1


def _count_read_dead(letter) -> tuple[str, int]:
    Metrics.counter(METRICS_NAMESPACE, "rows_in").inc()  # a row the reader could not read is a row in
    return _count_dead(letter)


def _count_id_fallbacks(split_batch: tuple[str, pa.RecordBatch], id_columns: Sequence[str]):
    """("<column>: <reason>", n) for the rows of a (split, batch) whose ID value has no key (``connectors.id_keys``)."""
    _, batch = split_batch
    for col in id_columns:
        for kind, n in reason_counts(batch.column(ID_PREFIX + col).to_numpy()).items():
            Metrics.counter(METRICS_NAMESPACE, f"id_fallbacks: {col}: {kind}").inc(n)
            yield f"{col}: {kind}", n


def _count_out(split: str, batch: pa.RecordBatch) -> tuple[str, int]:
    Metrics.counter(METRICS_NAMESPACE, "rows_out").inc(batch.num_rows)
    Metrics.counter(METRICS_NAMESPACE, f"rows_out: {split}").inc(batch.num_rows)
    return split, batch.num_rows


class _ValidateFn(beam.DoFn):
    def __init__(self, spec: FeatureSpec, extra_checks: ExtraChecks | None):
        self._spec, self._extra = spec, extra_checks
        self._rows_in = Metrics.counter(METRICS_NAMESPACE, "rows_in")
        self._bytes = Metrics.counter(METRICS_NAMESPACE, "bytes_read")
        self._ms = Metrics.distribution(METRICS_NAMESPACE, "validate_ms")

    def process(self, batch: pa.RecordBatch):
        t0 = time.perf_counter()
        self._rows_in.inc(batch.num_rows)
        self._bytes.inc(batch.nbytes)
        good, letters = split_valid(batch, self._spec, self._extra(batch) if self._extra else [])
        self._ms.update(int(1000 * (time.perf_counter() - t0)))
        if good.num_rows:
            yield good
        for letter in letters:
            yield beam.pvalue.TaggedOutput(ERRS, letter)


class ValidateRows(beam.PTransform):
    """RecordBatches -> usable rows (main) and ``DeadLetter``s (``errs``)."""

    def __init__(self, spec: FeatureSpec, extra_checks: ExtraChecks | None = None):
        super().__init__()
        self._spec, self._extra = spec, extra_checks

    def expand(self, batches):
        return batches | beam.ParDo(_ValidateFn(self._spec, self._extra)).with_outputs(ERRS, main="rows")


class _TimeRange(beam.CombineFn):
    def __init__(self, column: str, time_format: str | None = None):
        self._col, self._format = column, time_format

    def create_accumulator(self):
        return (np.inf, -np.inf)

    def add_input(self, acc, batch):
        t = time_seconds(batch.column(self._col), self._format)
        t = t[np.isfinite(t)]
        return (min(acc[0], t.min()), max(acc[1], t.max())) if t.size else acc

    def merge_accumulators(self, accs):
        accs = list(accs)
        return (min(a[0] for a in accs), max(a[1] for a in accs))

    def extract_output(self, acc):
        return acc


def _time_range(spec: FeatureSpec, rows, *, label: str):
    """A PCollection of one (min, max) of the time column over the valid rows, or of None."""
    if not spec.time_column:
        return rows.pipeline | f"{label}NoTimeRange" >> beam.Create([None])
    return rows | f"{label}TimeRange" >> beam.CombineGlobally(_TimeRange(spec.time_column, spec.time_format))


def _cutoffs(spec: FeatureSpec, time_range, *, label: str):
    """Side input with (valid_from, test_from) in seconds, or None (a random split)."""
    if not spec.time_column:
        return beam.pvalue.AsSingleton(time_range)
    if spec.valid_from and spec.test_from:
        fixed = (time_cutoff(spec.valid_from, spec.time_format), time_cutoff(spec.test_from, spec.time_format))
        return beam.pvalue.AsSingleton(time_range.pipeline | f"{label}Cutoffs" >> beam.Create([fixed]))
    f_train, f_valid, _ = spec.fractions

    def by_fraction(rng):
        lo, hi = rng
        if not np.isfinite(lo):
            return (0.0, 0.0)
        return (lo + (hi - lo) * f_train, lo + (hi - lo) * (f_train + f_valid))

    return beam.pvalue.AsSingleton(time_range | f"{label}ByFraction" >> beam.Map(by_fraction))


class _AssignSplitsFn(beam.DoFn):
    def __init__(self, spec: FeatureSpec, names: dict[str, str] | None = None):
        self._spec, self._names = spec, names

    def process(self, batch: pa.RecordBatch, cutoffs):
        codes = assign_splits(batch, self._spec, cutoffs, names=self._names)
        for i, name in enumerate(SPLITS):
            mask = codes == i
            if mask.any():
                yield name, batch.filter(pa.array(mask))


class _StatsFn(beam.CombineFn):
    def __init__(self, spec: FeatureSpec):
        self._spec = spec

    def create_accumulator(self):
        return StatsAccumulator()

    def add_input(self, acc, batch):
        return acc.add(batch, self._spec)

    def merge_accumulators(self, accs):
        accs = iter(accs)
        first = next(accs)
        for acc in accs:
            first.merge(acc)
        return first

    def extract_output(self, acc):
        return acc.finalize(self._spec)


class ComputeStats(beam.PTransform):
    """One full pass: mean/std per numeric column, vocabulary per categorical column."""

    def __init__(self, spec: FeatureSpec):
        super().__init__()
        self._spec = spec

    def expand(self, batches):
        return batches | beam.CombineGlobally(_StatsFn(self._spec))


class _CountByKey(beam.CombineFn):
    """(key, n) pairs -> {key: total}; partial dicts per bundle, so only a few numbers cross stages."""

    def create_accumulator(self):
        return {}

    def add_input(self, acc, pair):
        key, n = pair
        acc[key] = acc.get(key, 0) + n
        return acc

    def merge_accumulators(self, accs):
        out: dict = {}
        for acc in accs:
            for key, n in acc.items():
                out[key] = out.get(key, 0) + n
        return out

    def extract_output(self, acc):
        return acc


class _FeaturizeFn(beam.DoFn):
    def __init__(self, spec: FeatureSpec):
        self._spec = spec
        self._ms = Metrics.distribution(METRICS_NAMESPACE, "featurize_ms")

    def process(self, pair, stats):
        split, batch = pair
        t0 = time.perf_counter()
        features, letters = featurize_rows(batch, self._spec, stats)
        self._ms.update(int(1000 * (time.perf_counter() - t0)))
        if features.num_rows:
            yield split, features
        for letter in letters:
            yield beam.pvalue.TaggedOutput(ERRS, letter)


class FeaturizeSplits(beam.PTransform):
    """(split, valid batch) -> (split, feature batch) with the training statistics, and ``errs``:
    a dead letter per row whose label has no target (a class the training split never saw)."""

    def __init__(self, spec: FeatureSpec, stats):
        super().__init__()
        self._spec, self._stats = spec, stats

    def expand(self, split_batches):
        return split_batches | beam.ParDo(_FeaturizeFn(self._spec), stats=beam.pvalue.AsSingleton(self._stats)
                                          ).with_outputs(ERRS, main="features")


def _cutoffs_known_up_front(spec: FeatureSpec) -> bool:
    """True when the split of a row needs no pass over the data (a random split, or both dates given)."""
    return not spec.time_column or bool(spec.valid_from and spec.test_from)


def _spill_and_split(spec: FeatureSpec, rows, cutoffs, spill_dir: str, names: dict[str, str] | None = None):
    """(split, batch) twice: for the statistics, and read back from the spill for featurizing.

    The valid rows are written to temporary files in the stage that validates them, so the
    runner never holds them between the statistics pass and the featurize pass. When the split
    cutoffs are known up front the rows are split before the spill and the statistics are
    combined in the same stage; when they come from the time column's range (``--fractions``),
    the spill holds the unsplit rows and is read twice (statistics, then featurize).
    """
    if _cutoffs_known_up_front(spec):
        split_batches = rows | "AssignSplits" >> beam.ParDo(_AssignSplitsFn(spec, names), cutoffs)
        spilled = split_batches | "SpillRows" >> WriteToSpill(spill_dir)
        return split_batches, spilled | "ReadSpill" >> ReadFromSpill()
    spilled = rows | "KeyRows" >> beam.Map(lambda b: ("rows", b)) | "SpillRows" >> WriteToSpill(spill_dir)
    for_stats = (spilled | "ReadSpillForStats" >> ReadFromSpill() | "UnkeyForStats" >> beam.Values()
                 | "AssignSplits" >> beam.ParDo(_AssignSplitsFn(spec, names), cutoffs))
    back = (spilled | "ReadSpill" >> ReadFromSpill() | "Unkey" >> beam.Values()
            | "AssignSplitsAgain" >> beam.ParDo(_AssignSplitsFn(spec, names), cutoffs))
    return for_stats, back


def _remove_spill_then(manifest: dict, spill_dir: str) -> dict:
    remove_spill(spill_dir)
    return manifest


def build_etl(raw_batches, spec: FeatureSpec, *, dataset_path: str, dead_letters_path: str | None,
              extra_checks: ExtraChecks | None = None,
              extra_metadata: dict | None = None, rows_in=None, overwrite: bool = True, read_errs=None,
              file_names: dict[str, str] | None = None):
    """Wire the ETL after a reader; returns the PCollection holding the written manifest.

    ``rows_in`` counts the reader's rows (default: rows of ``raw_batches``); give it when
    rows were rejected before ``raw_batches`` (e.g. by a join's own checks) and fold those
    rejections into ``raw_batches``' dead letters yourself. ``read_errs``: the reader's own
    dead letters (``ReadFromFiles(..., with_errors=True)``), counted in and written out. ``file_names``
    (``splits.source_names``): each file's name as a random split hashes it (default: as read).

    Memory stays bounded with the data: the valid rows go to temporary files beside the dataset
    (``<dataset_path>.spill-<id>/``, through Beam's FileSystems) while the statistics are
    computed, and are read back to be featurized; the directory is removed once the manifest is
    written (``run_tabular_etl`` also removes it when the run fails). Counts and dead letters
    are combined per bundle; no step gathers rows or dead letters in one place.
    """
    rows, errs = raw_batches | "ValidateRows" >> ValidateRows(spec, extra_checks)
    time_range = _time_range(spec, rows, label="Split")
    cutoffs = _cutoffs(spec, time_range, label="Split")
    spill_dir = spill_directory(dataset_path)
    split_batches, spilled_back = _spill_and_split(spec, rows, cutoffs, spill_dir, file_names)
    train = (split_batches | "TrainOnly" >> beam.Filter(lambda kv: kv[0] == "train")
             | "TrainBatches" >> beam.Values())
    stats = train | "ComputeStats" >> ComputeStats(spec)
    featurized, unknown = spilled_back | "Featurize" >> FeaturizeSplits(spec, stats)
    # Dead letters come from up to three stages. They are counted and written where they are made,
    # never flattened first: a local runner would hold every dead letter of a Flatten in memory.
    sources = {"Validate": errs, "Featurize": unknown, **({"Read": read_errs} if read_errs is not None else {})}
    dead_counts = [letters | f"CountDead{name}" >> beam.Map(_count_read_dead if name == "Read" else _count_dead)
                   | f"SumDead{name}" >> beam.CombinePerKey(sum) for name, letters in sources.items()]
    dead = dead_counts | "AllDeadCounts" >> beam.Flatten() | "DeadDict" >> beam.CombineGlobally(_CountByKey())

    if rows_in is None:
        counts_in = [raw_batches | "CountIn" >> beam.Map(lambda b: b.num_rows) | "SumRead" >> beam.CombineGlobally(sum)]
        if read_errs is not None:
            counts_in.append(read_errs | "CountReadErrs" >> beam.Map(lambda _: 1)
                             | "SumReadErrs" >> beam.CombineGlobally(sum))
        rows_in = counts_in | "CountsIn" >> beam.Flatten() | "SumIn" >> beam.CombineGlobally(sum)
    rows_out = (featurized | "CountOut" >> beam.MapTuple(_count_out)
                | "OutDict" >> beam.CombineGlobally(_CountByKey()))
    # rows written whose ID value had no key (they use the fallback vector): {"<column>: <reason>": n}
    id_fallbacks = (featurized | "CountIdFallbacks" >> beam.FlatMap(_count_id_fallbacks, spec.id_columns)
                    | "IdFallbacksDict" >> beam.CombineGlobally(_CountByKey())) if spec.id_columns else None
    extra = dict(extra_metadata or {})

    def metadata(stats_, n_in, out, dead_, rng, cut, ids_=None):
        n_out, n_dead = sum(out.values()), sum(dead_.values())
        if n_in != n_out + n_dead:
            raise RuntimeError(f"row counts do not reconcile: in {n_in} != out {n_out} + dead letters {n_dead}")
        split = None
        if spec.time_column:
            lo, hi = rng
            split = {"time_column": spec.time_column, "min": float(lo) if np.isfinite(lo) else None,
                     "max": float(hi) if np.isfinite(hi) else None, "valid_from": cut[0], "test_from": cut[1]}
        return {**extra, "spec": spec.to_dict(), "stats": stats_, "split": split,
                "counts": {"in": n_in, "out": n_out, "dead_letters": n_dead, "out_by_split": out,
                           "dead_letters_by_reason": dead_, **({"id_fallbacks": ids_} if ids_ is not None else {})}}

    meta = stats | "Metadata" >> beam.Map(metadata, n_in=beam.pvalue.AsSingleton(rows_in),
                                          out=beam.pvalue.AsSingleton(rows_out),
                                          dead_=beam.pvalue.AsSingleton(dead),
                                          rng=beam.pvalue.AsSingleton(time_range), cut=cutoffs,
                                          **({"ids_": beam.pvalue.AsSingleton(id_fallbacks)} if id_fallbacks else {}))
    if dead_letters_path:
        _ = tuple(sources.values()) | "WriteDeadLetters" >> WriteDeadLettersToJsonl(dead_letters_path)
    manifest = featurized | "WriteDataset" >> WriteDataset(dataset_path, metadata=meta, overwrite=overwrite)
    return manifest | "RemoveSpill" >> beam.Map(_remove_spill_then, spill_dir)


def _temporaries(dataset_path: str, dead_letters_path: str | None) -> set[str]:
    """The temporaries an ETL into these paths makes, as they are now: the dataset's ``.tmp-*`` and
    ``.spill-*``, the dead letters' ``.parts-*`` and ``.tmp-*``, Beam's ``beam-temp-<name>-*``."""
    found: set[str] = set()
    if FileSystems.get_scheme(dataset_path) is None:
        dataset = Path(dataset_path).resolve()
        found |= {str(p) for p in [*dataset.parent.glob(f"{dataset.name}.tmp-*"),
                                   *dataset.parent.glob(f"{dataset.name}{SPILL_SUFFIX}*")]}
    else:  # an object store: the spill's objects under <dataset_path>.spill-<id>/
        found |= {m.path for m in FileSystems.match([f"{dataset_path.rstrip('/')}{SPILL_SUFFIX}**"])[0].metadata_list}
    if dead_letters_path and FileSystems.get_scheme(dead_letters_path) is None:
        dead = Path(dead_letters_path).resolve()
        found |= {str(p) for p in [*dead.parent.glob(f"beam-temp-{dead.name}-*"),
                                   *dead.parent.glob(f"{dead.name}{PARTS_SUFFIX}*"),
                                   *dead.parent.glob(f"{dead.name}.tmp-*")]}
    return found


def remove_temporaries(dataset_path: str, dead_letters_path: str | None, *, keep: set[str] | frozenset = frozenset()
                       ) -> None:
    """What a failed run leaves: the dataset's ``.tmp-*`` and ``.spill-*`` directories, the dead
    letters' ``.parts-*`` and ``.tmp-*``, and Beam's ``beam-temp-<dead letters' name>-*``; those in
    ``keep`` (what existed before this job started: another job's) stay."""
    for tmp in sorted(_temporaries(dataset_path, dead_letters_path) - set(keep)):
        if FileSystems.get_scheme(tmp) is not None:
            FileSystems.delete([tmp])
        elif Path(tmp).is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            Path(tmp).unlink(missing_ok=True)


@contextmanager
def etl_cleanup(dataset_path: str, dead_letters_path: str | None):
    """Run an ETL into ``dataset_path`` in this block: when it fails, or SIGTERM / SIGHUP stop it, the
    temporaries it made are removed (``remove_temporaries``; those of another job that existed before
    stay) and a signal ends the process as ``SystemExit(128 + signal)``."""
    before = _temporaries(dataset_path, dead_letters_path)
    signals: list[int] = []
    try:
        with _termination_raises() as signals:
            yield
    except BaseException:
        remove_temporaries(dataset_path, dead_letters_path, keep=before)
        if signals:  # terminated: end as the signal asked, whatever step Beam says it stopped in
            raise SystemExit(128 + signals[0]) from None
        raise


@contextmanager
def _termination_raises():
    """SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread while the block runs,
    so a terminated ETL unwinds through its cleanup (a handler installed before runs first). Yields
    the list of signals received (Beam wraps an exception raised inside a step: the caller re-raises)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {}

    def handler(signum, frame):
        before = previous.get(signum)
        if before is signal.SIG_IGN:
            return
        received.append(signum)
        if callable(before):
            before(signum, frame)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield received
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before if before is not None else signal.SIG_DFL)


def run_tabular_etl(inputs: Sequence[str], spec: FeatureSpec, *, dataset_path: str,
                    dead_letters_path: str | None, options, max_record_bytes: int = MAX_RECORD_BYTES,
                    extra_metadata: dict | None = None) -> dict:
    """Pre-flight the files, run the ETL, return the manifest.

    Files are read with the declared column types (``schema.read_types``): a row that cannot
    be read or whose value does not fit becomes a dead letter naming its file and line; so does a
    CSV record or JSON line longer than ``max_record_bytes``. A failure, SIGTERM or SIGHUP
    included, leaves none of this job's temporary files behind (another job's stay); an empty
    split is a ``SplitError``. ``extra_metadata``: more keys for the manifest (the inferred columns).
    """
    files = expand_inputs(inputs)
    spec, _ = resolve_task(files, spec)
    preflight(files, spec, max_record_bytes=max_record_bytes)
    with etl_cleanup(dataset_path, dead_letters_path), beam.Pipeline(options=options) as p:
        raw, read_errs = p | "ReadFiles" >> ReadFromFiles(
            files, with_source=True, columns=[*spec.input_columns], column_types=read_types(spec),
            with_errors=True, max_record_bytes=max_record_bytes)
        build_etl(raw, spec, dataset_path=dataset_path, dead_letters_path=dead_letters_path,
                  extra_metadata={**(extra_metadata or {}), "inputs": [origin_of(f) for f in files]},  # URLs as given
                  read_errs=read_errs,
                  file_names=source_names(files))  # a random split by names relative to the inputs' root
    manifest = read_manifest(dataset_path)
    check_splits(manifest)
    return manifest
