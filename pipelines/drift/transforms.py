"""``WriteDriftCounts``: a Beam transform that counts batches of model inputs into a reference profile's buckets
(``pipelines.drift.profile.Counter``), adds them up and writes the total as one JSON file (``flowtrain predict``'s
drift section: the features and the label; the caller adds the scores from its predictions)."""
from __future__ import annotations

import json

import apache_beam as beam
import numpy as np

from connectors.dataset_spec import FeatureSpec
from pipelines.drift.profile import Counter, counts_to_json, merge


class _CountFn(beam.DoFn):
    def __init__(self, profile: dict, spec: FeatureSpec, stats: dict):
        self.profile, self.spec, self.stats = profile, spec, stats

    def setup(self):
        self.counter = Counter(self.profile)

    def process(self, inp):  # a pipelines.predict.rows.PredictionInput
        from pipelines.tabular.labels import encode_labels

        label = None
        if self.spec.label in inp.carry.schema.names:
            targets, known = encode_labels(inp.carry.column(self.spec.label), self.spec, self.stats)
            label = np.where(known, targets, np.nan)
        yield self.counter.count(inp.features, label)


class _Sum:
    """Adds window counts (associative: Beam may add partial sums); an empty input is the empty window."""

    def __init__(self, profile: dict):
        self.profile = profile

    def __call__(self, parts):
        total = Counter(self.profile).empty()
        for part in parts:
            total = merge(total, part)
        return total


class WriteDriftCounts(beam.PTransform):
    """``PredictionInput``s -> their counts in ``profile``'s buckets, summed, as JSON at ``path``."""

    def __init__(self, profile: dict, spec: FeatureSpec, stats: dict, path: str):
        super().__init__()
        self.profile, self.spec, self.stats, self.path = profile, spec, stats, path

    def expand(self, inputs):
        return (inputs | "Count" >> beam.ParDo(_CountFn(self.profile, self.spec, self.stats))
                | "Sum" >> beam.CombineGlobally(_Sum(self.profile))
                | "Json" >> beam.Map(lambda c: json.dumps(counts_to_json(c)))
                | "Write" >> beam.io.WriteToText(self.path, shard_name_template=""))
