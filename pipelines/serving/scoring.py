"""Score a live stream of any dataset's events with Beam ``RunInference``, hot-swapping published versions.

    ReadFromKafka(raw events, from the scorer group's committed offsets)
      -> FeaturizeForScoring (fused with the read, per partition): micro-batches featurized by the
         stream pipeline's ``StreamFeaturizer`` (the batch dataset's statistics and vocabularies);
         bad events to the dead-letter topic, confirmed before the micro-batch moves on
      -> Reshuffle                                            (a stage of its own, see below)
      -> NotBeforeFirstTick: a micro-batch stamped before the versions' first tick moves to its window (below)
      -> WindowInto(FixedWindows(swap_interval))              (the serving windows)
      -> RunInference(FlowtrainModelHandler, model_metadata_pcoll=versions)
           versions = PeriodicImpulse(swap_interval) -> WindowInto(the same FixedWindows)
                      -> LatestModelVersion (the newest valid, authenticated version on the updates topic)
      -> WritePredictions: Arrow record batches on the predictions topic (``PREDICTION_SCHEMA``), acknowledged
      -> CommitScored (keyed by raw partition, Beam state): commits the raw offsets up to which
         every event has its prediction or dead letter acknowledged (at least once).

Hot swap is Beam's own model-update mechanism: a ``ModelMetadata`` side input of
``RunInference``. Beam's documented sources for it (``WatchFilePattern``, or a topic in the global
window with a repeated trigger) are unbounded *global-window triggered* side inputs, which Prism
refuses at submission (``jobservices/management.go``: "Unbounded GlobalWindow Triggered SideInput,
are not currently supported by Prism", apache/beam#31438: Prism makes a side input ready only at
the end of its window, and a global window never ends). So the versions come as Beam's "slowly
updating side input": a ``PeriodicImpulse`` tick per window looks up the newest valid version,
and the main input is windowed in the same fixed windows. Prism runs a stage that reads a side
input only once the side input's output watermark has reached the stage's input watermark
(``engine/elementmanager.go``, ``bundleReady``), so an event waits at most about one window for
its model. That rule is also why the ``Reshuffle`` is there: Prism fuses the Kafka read with its
consumers, and the read's input (after its partition impulse) is at the end of time, so a
side-input consumer fused with the read never runs (measured: no output at all); after the
reshuffle the scoring stage's input watermark is the read's output.

Why ``NotBeforeFirstTick``: the ticks start in the serving window that holds the time the
pipeline is built, and a micro-batch is stamped with its newest Kafka timestamp, so a backlog (events
produced before the scorer started, a replay with its own event times, a producer whose clock is
behind) falls in windows that have no tick. Prism reads such a window's side input as empty (the
handler then serves the newest version it has loaded), but Flink's portable runner never does:
``DoFnOperator`` pushes an element back until the side input holds a value *for its window*
(``SideInputHandler.isReady``) and releases pushed-back elements otherwise only when the side
input's watermark reaches the end of time (``processWatermark1`` / ``emitAllPushedBackData``), so
those events would wait forever and hold the job's watermark (measured on Flink 1.19 with Beam
2.62: every subtask RUNNING, the backlog's micro-batches at the scoring stage, no prediction).
Moved to the first tick's window, they have a side input on every runner; a live event keeps its
Kafka timestamp, which Prism's side-input timing above relies on (measured: with every micro-batch
stamped with the time it was featurized, a newly published version did not serve within 60 s on
Prism). Predictions carry each event's own ``event_time`` either way.

This package needs no flowtrain import (imports flow flowtrain -> pipelines): the caller passes
``load_version``, a picklable callable ``(path, sha256=None) -> (torch module in eval mode, version)``.
"""
from __future__ import annotations

import time

import apache_beam as beam
from apache_beam.ml.inference.base import RunInference
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Timestamp

from connectors.kafka import ReadFromKafka
from pipelines.serving.commit import CommitScored
from pipelines.serving.config import ScoreConfig
from pipelines.serving.featurize import FeaturizeForScoring
from pipelines.serving.handler import FlowtrainModelHandler
from pipelines.serving.predictions import WritePredictions
from pipelines.serving.updates import WINDOW_OFFSET_S, LatestModelVersion, first_tick
from pipelines.serving.versions import ModelVersion

__all__ = ["build_scoring_pipeline", "model_handler"]


def model_handler(cfg: ScoreConfig) -> FlowtrainModelHandler:
    return FlowtrainModelHandler(cfg.load_version, ModelVersion.from_model_id(cfg.initial_model), cfg.spec,
                                 cache_dir=cfg.model_cache_dir or None, device=cfg.device,
                                 max_batch_size=cfg.max_inference_batches, target_scale=cfg.target_scale,
                                 n_classes=cfg.n_classes, torch_threads=cfg.torch_threads)


class _NotBeforeFirstTick(beam.DoFn):
    """A micro-batch stamped before the first tick moves to the first tick's window (see the module doc)."""

    def __init__(self, first_tick_s: float):
        self.first = Timestamp.of(first_tick_s)

    def process(self, batch, timestamp=beam.DoFn.TimestampParam):
        yield batch if timestamp >= self.first else window.TimestampedValue(batch, self.first)


def build_scoring_pipeline(pipeline: beam.Pipeline, cfg: ScoreConfig):
    """The scoring pipeline (see the module doc); returns the committed-offsets PCollection."""
    if not cfg.initial_model:
        raise ValueError("ScoreConfig.initial_model: the version to serve first is required "
                         "(wait_for_version finds the newest valid one on the updates topic)")
    if not cfg.model_cache_dir:
        raise ValueError("ScoreConfig.model_cache_dir: the scorer's own copies of the versions it serves "
                         "(`flowtrain stream score` uses <out>/models)")
    raw = pipeline | "ReadRaw" >> ReadFromKafka(cfg.bootstrap, cfg.raw_topic, start="committed",
                                                group_id=cfg.score_group_id, commit_offsets=False,
                                                consumer_config=cfg.kafka_config, max_read_s=cfg.max_read_s,
                                                batch_records=cfg.read_batch_records)
    start = time.time()
    versions = pipeline | "ModelVersions" >> LatestModelVersion(cfg, start=start)
    return (raw
            | "Featurize" >> FeaturizeForScoring(cfg)
            | "ToScorers" >> beam.Reshuffle()
            | "NotBeforeFirstTick" >> beam.ParDo(_NotBeforeFirstTick(first_tick(start, cfg.swap_interval)))
            | "ServingWindows" >> beam.WindowInto(window.FixedWindows(cfg.swap_interval, offset=WINDOW_OFFSET_S))
            | "Score" >> RunInference(model_handler(cfg), model_metadata_pcoll=versions)
            | "WritePredictions" >> WritePredictions(cfg)
            | "Commit" >> CommitScored(cfg))
