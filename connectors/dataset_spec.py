"""The dataset contract: the label, its task, the feature columns and how rows split.

Both sides read it: the Beam pipelines write datasets by it (into the manifest), the training
engine and the streaming pipeline read it back, so all agree on the columns. A plain dataclass,
read from CLI flags or YAML.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Task = Literal["classification", "regression"]
#: ``time_format`` values for numeric times: seconds (the default for numbers) or finer units.
EPOCH_FORMATS = {"epoch": 1.0, "epoch_s": 1.0, "epoch_ms": 1e3, "epoch_us": 1e6, "epoch_ns": 1e9}

#: Feature columns in a dataset: numerics are standardized float32, categoricals int32 codes.
NUM_PREFIX = "num__"
CAT_PREFIX = "cat__"
LABEL = "label"
SOURCE = "source"
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
    #: classification, a float label a regression; see ``pipelines.tabular.pipeline.infer_task``).
    task: Task | None = "regression"
    numeric: list[str] = field(default_factory=list)
    categorical: list[str] = field(default_factory=list)
    #: Numeric columns that may be missing: a null becomes the training mean (0 once
    #: standardized) instead of sending the row to dead letters.
    optional_numeric: list[str] = field(default_factory=list)
    #: For classification: a label above this threshold is the positive class (None: the classes
    #: are the label's distinct values in the training split, stored in the manifest).
    positive_above: float | None = None
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

    def __post_init__(self) -> None:
        if self.task not in ("classification", "regression", None):
            raise ValueError(f"task must be 'classification' or 'regression', not {self.task!r}")
        if not self.numeric and not self.categorical and not self.optional_numeric:
            raise ValueError("declare at least one feature column (--numeric or --categorical)")
        cols = [self.label, *self.numeric, *self.optional_numeric, *self.categorical]
        dup = {c for c in cols if cols.count(c) > 1}
        if dup:
            raise ValueError(f"columns declared twice (label/numeric/categorical): {sorted(dup)}")
        if abs(sum(self.fractions) - 1.0) > 1e-6 or len(self.fractions) != 3:
            raise ValueError(f"fractions must be three numbers summing to 1, got {self.fractions}")
        self.fractions = tuple(float(f) for f in self.fractions)

    @property
    def all_numeric(self) -> list[str]:
        return [*self.numeric, *self.optional_numeric]

    @property
    def input_columns(self) -> list[str]:
        cols = [self.label, *self.all_numeric, *self.categorical]
        if self.time_column and self.time_column not in cols:
            cols.append(self.time_column)
        return cols

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSpec:
        data = dict(data)
        if "fractions" in data:
            data["fractions"] = tuple(data["fractions"])
        return cls(**data)
