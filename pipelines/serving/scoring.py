"""Score a live stream of any dataset's events with Beam ``RunInference``, hot-swapping published versions.

    ReadFromKafka(raw events, from the scorer group's committed offsets)
      -> FeaturizeForScoring (fused with the read, per partition): micro-batches featurized by the
         stream pipeline's ``StreamFeaturizer`` (the batch dataset's statistics and vocabularies);
         bad events to the dead-letter topic, confirmed before the micro-batch moves on
      -> Reshuffle                       (scoring spread over the workers, not tied to the partition's reader)
      -> RunInference(FlowtrainModelHandler(newest=NewestVersion))
      -> WritePredictions: record batches on the predictions topic (``prediction_layout``: the pred_* columns,
         the id and the label), acknowledged
      -> CommitScored (keyed by raw partition, Beam state): commits the raw offsets up to which
         every event has its prediction or dead letter acknowledged (at least once).

Hot swap: the model handler asks ``NewestVersion`` before each forward, a reader thread per worker process
that reads the updates topic every ``--swap-interval`` seconds into a ``VersionTracker`` (the newest valid,
authenticated version), and scores with that version, loading it once per process when it is newer than the
model RunInference holds. A version is therefore served by every micro-batch scored about one
``--swap-interval`` (plus its load) after its publication, on any runner and whatever the events' timestamps:
a replayed history with its own old event times, a backlog, a live stream alike.

Why not RunInference's ``model_metadata_pcoll`` side input (Beam's documented hot swap): its global-window form
(``WatchFilePattern``, a topic with a repeated trigger) is refused by Prism (apache/beam#31438), and the windowed
"slowly updating side input" this scorer used before depends on windows and watermarks the scorer does not
control: Prism ran a main-input bundle as soon as the side input's watermark reached the stage's input
watermark, so a micro-batch stamped ahead of it was scored with an *empty* side input, i.e. with the model
loaded last, and a newly published version reached only the windows that happened to see it (measured: 300 of
300 events scored with v2, v3 published 20 s before, issue #42); events stamped before the first tick (a
replay with ``--time-column``) were all served by the first version; and Flink's portable runner holds an
element until its window's side input exists. The reader thread has none of these dependencies.

This package needs no flowtrain import (imports flow flowtrain -> pipelines): the caller passes
``load_version``, a picklable callable ``(path, sha256=None) -> (torch module in eval mode, version)``.
"""
from __future__ import annotations

import apache_beam as beam
from apache_beam.ml.inference.base import RunInference

from connectors.kafka import ReadFromKafka
from pipelines.serving.commit import CommitScored
from pipelines.serving.config import ScoreConfig
from pipelines.serving.featurize import FeaturizeForScoring
from pipelines.serving.handler import FlowtrainModelHandler
from pipelines.serving.predictions import WritePredictions
from pipelines.serving.updates import NewestVersion
from pipelines.serving.versions import ModelVersion
from pipelines.stream.options import DEFAULT_READ_BATCH_RECORDS
from pipelines.stream.steps import live_read_s

__all__ = ["build_scoring_pipeline", "model_handler"]


def model_handler(cfg: ScoreConfig) -> FlowtrainModelHandler:
    """RunInference's handler for ``cfg``: ``cfg.initial_model`` first, then the newest valid version on the updates
    topic (``NewestVersion``)."""
    return FlowtrainModelHandler(cfg.load_version, ModelVersion.from_model_id(cfg.initial_model), cfg.spec,
                                 cache_dir=cfg.model_cache_dir or None, device="cpu",
                                 max_batch_size=cfg.max_inference_batches, target_scale=cfg.target_scale,
                                 n_classes=cfg.n_classes, torch_threads=cfg.torch_threads,
                                 newest=NewestVersion(cfg), warn_after_s=max(10.0, 5 * cfg.swap_interval))


def build_scoring_pipeline(pipeline: beam.Pipeline, cfg: ScoreConfig):
    """The scoring pipeline (see the module doc); returns the committed-offsets PCollection."""
    if not cfg.initial_model:
        raise ValueError("ScoreConfig.initial_model: the version to serve first is required "
                         "(wait_for_version finds the newest valid one on the updates topic)")
    if not cfg.model_cache_dir:
        raise ValueError("ScoreConfig.model_cache_dir: the scorer's own copies of the versions it serves "
                         "(`flowtrain stream score` uses <out>/models)")
    raw = pipeline | "ReadRaw" >> ReadFromKafka(cfg.kafka.bootstrap, cfg.topics.raw, start="committed",
                                                group_id=cfg.score_group_id, commit_offsets=False,
                                                consumer_config=cfg.kafka.config, max_read_s=cfg.max_read_s,
                                                live_read_s=live_read_s(cfg.score_max_delay),
                                                batch_records=DEFAULT_READ_BATCH_RECORDS)
    return (raw
            | "Featurize" >> FeaturizeForScoring(cfg)
            | "ToScorers" >> beam.Reshuffle()
            | "Score" >> RunInference(model_handler(cfg))
            | "WritePredictions" >> WritePredictions(cfg)
            | "Commit" >> CommitScored(cfg))
