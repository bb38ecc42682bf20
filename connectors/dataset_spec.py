"""The dataset contract: the label, its task, the feature columns and how rows split.

Both sides read it: the Beam pipelines write datasets by it (into the manifest), the training
engine and the streaming pipeline read it back, so all agree on the columns. A plain dataclass,
read from CLI flags or YAML.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

Task = Literal["classification", "regression"]
#: ``time_format`` values for numeric times: seconds (the default for numbers) or finer units.
EPOCH_FORMATS = {"epoch": 1.0, "epoch_s": 1.0, "epoch_ms": 1e3, "epoch_us": 1e6, "epoch_ns": 1e9}

#: Feature columns in a dataset: numerics are standardized float32, categoricals int32 codes.
NUM_PREFIX = "num__"
CAT_PREFIX = "cat__"
ID_PREFIX = "id__"  # an ID column's 64-bit keys (connectors.id_keys): ID tables, not vocabularies
LABEL = "label"
SOURCE = "source"
#: A dataset's per-row sample weight (``--weight-column``: the column's value as given, float32), never a feature.
WEIGHT = "weight"
SPLITS = ("train", "valid", "test")
#: The most classes a classification label may have (in the training split): more is almost surely a
#: numeric target or an id. The ETL stops as soon as it sees one more, naming the label and the fix.
MAX_CLASSES = 1000
#: A categorical column's value counter holds at most this many times ``max_vocab`` values (a
#: Misra-Gries heavy-hitters summary beyond that: the vocabulary is exact while a column has fewer
#: distinct values, and every value more frequent than 1/(that many) of the rows is always kept).
VOCAB_SKETCH_FACTOR = 4


@dataclass
class FeatureSpec:
    label: str
    #: None: decided from the label's type before the ETL runs (a string or boolean label is a
    #: classification, a float label a regression; see ``pipelines.tabular.preflight.infer_task``).
    task: Task | None = "regression"
    numeric: list[str] = field(default_factory=list)
    categorical: list[str] = field(default_factory=list)
    #: Numeric columns that may be missing: a null becomes the training mean (0 once
    #: standardized) instead of sending the row to dead letters.
    optional_numeric: list[str] = field(default_factory=list)
    #: For classification: a label above this threshold is the positive class (None: the classes
    #: are the label's distinct values in the training split, stored in the manifest).
    positive_above: float | None = None
    #: For a two-class label: the positive class (its probability is what a binary model predicts; the
    #: statistics' ``classes`` list it second). None: the later of the two in sorted order (``no``/``yes``:
    #: ``yes``; ``churned``/``stayed``: ``stayed``). ``positive_class_of`` names it for any dataset.
    positive_class: str | None = None
    #: Split by this time column (no leakage: train < valid_from <= valid < test_from <= test);
    #: None splits at random by ``seed``.
    time_column: str | None = None
    valid_from: str | None = None
    test_from: str | None = None
    #: How the time column (and the cutoffs) are written when it is text: a ``strptime`` format
    #: (e.g. ``%d.%m.%Y``), or ``epoch``/``epoch_ms``/``epoch_us``/``epoch_ns`` for numbers; None
    #: reads ISO dates and timestamps, ``YYYY/MM/DD`` and epoch seconds.
    time_format: str | None = None
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    seed: int = 0
    #: Categories seen fewer times than this in the training split map to the OOV code 0.
    min_count: int = 1
    max_vocab: int = 10_000
    #: Declared ranges of numeric columns, ``{column: [low, high]}`` (``--numeric-range col=LO:HI``). A value
    #: outside its column's range is a dead letter (in the ETL, the stream and predict alike). A column without
    #: one gets a range from the training statistics (``max_abs`` in its statistics: ``pipelines.tabular.ranges``).
    numeric_range: dict[str, list[float]] = field(default_factory=dict)
    #: ``--clip-outliers``: a value outside its column's range (declared or from the statistics) is clipped to
    #: it instead of making its row a dead letter.
    clip_numeric: bool = False
    #: ``--id-columns``: high-cardinality ID columns (users, items, devices). No vocabulary: the ETL keeps each
    #: value's stable 64-bit key (``connectors.id_keys``) and the model gives them dynamic embedding tables
    #: (``flowtrain.train.ids``); a value without a key (missing, empty, over ``max_id_bytes``) uses the fallback.
    id_columns: list[str] = field(default_factory=list)
    max_id_bytes: int = 256
    #: ``--required-ids``: ID columns whose value must have a key: a row with one missing, empty, too long or of a
    #: wrong type is a dead letter with its reason (in the ETL, the stream and predict alike), not the fallback.
    required_ids: list[str] = field(default_factory=list)
    #: ``--weight-column``: a numeric column of per-row sample weights (finite, >= 0; a row of weight w counts w
    #: times in the training loss and the weighted metrics). Never a feature; a bad value is a dead letter; only
    #: rows that are trained on need it (rows to predict or score may lack it).
    weight_column: str | None = None

    def __post_init__(self) -> None:
        if self.task not in ("classification", "regression", None):
            raise ValueError(f"task must be 'classification' or 'regression', not {self.task!r}")
        if not self.numeric and not self.categorical and not self.optional_numeric and not self.id_columns:
            raise ValueError("declare at least one feature column (--numeric or --categorical)")
        cols = [self.label, *self.numeric, *self.optional_numeric, *self.categorical, *self.id_columns,
                *([self.weight_column] if self.weight_column else [])]
        dup = {c for c in cols if cols.count(c) > 1}
        if dup:
            raise ValueError(f"columns declared twice (label/numeric/categorical/weight): {sorted(dup)}")
        if self.weight_column is not None and self.weight_column == self.time_column:
            raise ValueError(f"--weight-column {self.weight_column!r} is the time column; name a column of weights")
        if self.positive_class is not None:
            if self.positive_above is not None:
                raise ValueError("give --positive-class (a class of the label) or --positive-above (a threshold "
                                 "on a numeric label), not both")
            if self.task == "regression":
                raise ValueError("--positive-class is for a classification label; leave out --task regression")
            self.positive_class = str(self.positive_class)
        self.numeric_range = _ranges(self.numeric_range, self.all_numeric)
        self.required_ids = list(self.required_ids)
        stray = [c for c in self.required_ids if c not in self.id_columns]
        if stray:
            raise ValueError(f"--required-ids {','.join(stray)}: not among the ID columns (--id-columns "
                             f"{','.join(self.id_columns) or '(none)'}); name ID columns only")
        self.clip_numeric = bool(self.clip_numeric)
        if abs(sum(self.fractions) - 1.0) > 1e-6 or len(self.fractions) != 3:
            raise ValueError(f"fractions must be three numbers summing to 1, got {self.fractions}")
        self.fractions = tuple(float(f) for f in self.fractions)

    @property
    def all_numeric(self) -> list[str]:
        return [*self.numeric, *self.optional_numeric]

    @property
    def input_columns(self) -> list[str]:
        cols = [self.label, *self.all_numeric, *self.categorical, *self.id_columns]
        if self.time_column and self.time_column not in cols:
            cols.append(self.time_column)
        if self.weight_column:
            cols.append(self.weight_column)
        return cols

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["positive_class"] is None:  # unset: a manifest as before (readable by earlier versions)
            del data["positive_class"]
        for name, unset in (("numeric_range", {}), ("clip_numeric", False), ("id_columns", []),
                            ("max_id_bytes", 256), ("required_ids", []), ("weight_column", None)):  # likewise
            if data[name] == unset:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSpec:
        data = dict(data)
        if "fractions" in data:
            data["fractions"] = tuple(data["fractions"])
        return cls(**data)


def _ranges(given, numeric: list[str]) -> dict[str, list[float]]:
    """``numeric_range`` checked: each a declared numeric column's ``[low, high]``, finite, low <= high."""
    if not isinstance(given, dict):
        raise ValueError(f"numeric_range must map numeric columns to [low, high], not {given!r}")
    out = {}
    for col, bounds in given.items():
        if col not in numeric:
            raise ValueError(f"--numeric-range {col}: {col!r} is not a declared numeric column "
                             f"({', '.join(numeric) or 'none'})")
        try:
            lo, hi = (float(b) for b in bounds)
        except (TypeError, ValueError):
            raise ValueError(f"--numeric-range {col}: give two numbers LO:HI, not {bounds!r}") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ValueError(f"--numeric-range {col}={lo:g}:{hi:g}: give finite numbers with LO <= HI")
        out[str(col)] = [lo, hi]
    return out


def positive_class_of(spec: FeatureSpec | dict, stats: dict) -> str | None:
    """The positive class of a binary classification dataset (``spec`` and the manifest's ``stats``), the
    class whose probability a binary model predicts: ``--positive-class``'s, else the later of the two
    classes in sorted order; ``"1"`` (label above the threshold) with ``positive_above``. None for
    regression and for more than two classes."""
    spec = spec if isinstance(spec, FeatureSpec) else FeatureSpec.from_dict(spec)
    if spec.task != "classification":
        return None
    if "positive_class" in stats:
        return stats["positive_class"]
    classes = stats.get("classes") or (["0", "1"] if spec.positive_above is not None else [])
    return str(classes[1]) if len(classes) == 2 else None
