"""The scorer's options, declared once next to the engine that reads them (``connectors.fields``: each field is a
flag, a ``--config`` key and a ``config.json`` key, with its default, range and help).

``ScorerOptions``: the scoring pipeline's micro-batches, consumer group, serving window, ids in predictions, the
predictions' format and its model copies. Their names are the user's (``score_batch_size``, ``swap_interval``...:
one flat namespace with the feature pipeline's options). ``flowtrain stream score``'s job
(``flowtrain.commands.stream.options.ScoreOptions``) composes them with what only the command reads (topics, the wait for a
first model, drift monitoring), and the engine's ``pipelines.serving.config.ScoreConfig`` is them (with the raw
events' options, ``pipelines.stream.options.EventOptions``) plus what the command resolves. Stdlib only:
``flowtrain --help`` imports this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from connectors.fields import COMPOSED, above, at_least, narrow, option
from connectors.model_updates import DEFAULT_MAX_MODEL_BYTES

#: The --help section of the scorer's options (``option(..., group=...)``).
SCORING = "scoring (`stream score`, `stream --score`)"
#: --predictions-format: the formats ``pipelines.serving.codec.PredictionsCodec`` writes.
PREDICTIONS_FORMATS = ("arrow", "json", "avro", "protobuf")


@dataclass
class IdColumn:
    """``--id-column``: the column that identifies a row or event, copied into its prediction (the scorer's, section
    score; ``flowtrain predict``'s and ``flowtrain predictions``' too)."""

    SECTION: ClassVar[str] = COMPOSED
    id_column: str | None = option(
        None, "an event field (e.g. an order id) copied into its prediction as 'id', beside 'source'",
        metavar="COL", group=SCORING)


@dataclass
class PredictionsFormat:
    """``--predictions-format``: how the scorer's predictions are written (section score: one of
    ``PREDICTIONS_FORMATS``) and how ``flowtrain predictions`` reads them (``auto`` too: Arrow or JSON, by message)."""

    SECTION: ClassVar[str] = COMPOSED
    predictions_format: str | None = option(
        None, "how predictions are written: arrow (one record batch per message), json (one object per prediction), "
              "avro or protobuf (one record per prediction; with --schema-registry in its wire format, the schema "
              "registered under TOPIC-value) (default: as the events: --event-format json gives arrow)",
        choices=("auto", *PREDICTIONS_FORMATS), group=SCORING)


@dataclass
class MaxIdBytes:
    """``--max-id-bytes``: the longest ID value (UTF-8 bytes), the scorer's --id-column (section score) and a batch
    run's ID columns (``flowtrain batch``, its own default and help)."""

    SECTION: ClassVar[str] = COMPOSED
    max_id_bytes: int = option(
        1024, "the longest --id-column value (UTF-8 bytes) copied into a prediction; an event with a longer one "
              "is a scoring dead letter", parse=at_least(1), group=SCORING)


@dataclass
@narrow(predictions_format={"choices": PREDICTIONS_FORMATS})  # the scorer writes one format: no auto
class ScorerStream(PredictionsFormat, IdColumn):
    """The scorer's stream: the id it copies and the predictions' format, its consumer group, the serving window and
    its micro-batches."""

    SECTION: ClassVar[str] = "score"  # --config's score: {batch_size: 64} is score_batch_size (connectors.sections)
    score_group_id: str = option("flowtrain-scorer", "the scorer's consumer group on the raw topic", group=SCORING)
    swap_interval: float = option(
        1.0, "seconds between look-ups of the newest model version; also the serving window, about the longest an "
             "event waits for its model", parse=above(0), group=SCORING)
    # the featurizer's cost per event falls with the micro-batch (the stream pipeline's size)
    score_batch_size: int = option(2000, "events per scoring micro-batch, closed by size ...", parse=at_least(1),
                                   group=SCORING)
    score_max_delay: float = option(0.25, "... or this many seconds after its first event", parse=above(0),
                                    group=SCORING)


@dataclass
class ScorerOptions(MaxIdBytes, ScorerStream):
    """The scoring pipeline: RunInference with the newest published version."""

    SECTION: ClassVar[str] = "score"
    keep_models: int = option(3, "versions the scorer keeps its own copy of, in <out>/models", parse=at_least(1),
                              group=SCORING)
    max_model_bytes: int = option(DEFAULT_MAX_MODEL_BYTES, "the largest model file the scorer reads; a larger one "
                                                           "is rejected", parse=at_least(1), group=SCORING)
