"""``flowtrain predictions``: a scorer's predictions topic read back as a table, in any of the scorer's formats
(``--predictions-format``: Arrow record batches, JSON, Avro, Protobuf; with a Schema Registry or the dataset's
columns), so no one writes a Kafka consumer to see results. This module holds the options (``PredictionsJob``);
the reading is ``stream.predictions_read``'s (Kafka, pyarrow and the codecs are imported when a command runs, not for
``flowtrain --help``):

``predictions_read.run_predictions(job)`` reads the topic from its beginning to its end (``--follow``: then on,
until Ctrl-C or SIGTERM) and writes the rows to ``--out`` (Parquet, or CSV for ``.csv``) or as CSV to stdout;
``read_predictions`` (``flowtrain.predictions``) returns them as a pyarrow Table. The columns are the scorer's
(``pred_*`` and the event's id and label: ``pipelines.serving.predictions``)."""
from __future__ import annotations

from dataclasses import dataclass

from connectors.fields import at_least, narrow, option, store_path, tailor
from flowtrain.commands.shared_options import Dataset, Limit, Out, Overwrite
from flowtrain.commands.stream.options import KafkaOptions, Topic
from pipelines.serving.options import IdColumn, PredictionsFormat
from pipelines.stream.options import SchemaRegistryOption

_READ = "what to read"


@dataclass
@tailor(id_column={"help": "with --dataset: the scorer's --id-column", "group": _READ, "metavar": None},
        schema_registry={"help": "the Schema Registry the scorer registered its Avro/Protobuf predictions' schema "
                                 "with", "group": _READ},
        overwrite={"help": "replace an existing --out", "group": _READ},
        topic={"help": "the predictions topic (the scorer's --predictions-topic; default with --dataset: the "
                       "dataset's, as the scorer names it)", "group": _READ},
        limit={"help": "stop after this many predictions", "group": _READ},
        out={"help": "write the predictions to this file: Parquet, or CSV when it ends in .csv (default: CSV on "
                     "stdout)", "group": _READ},
        dataset={"help": "the dataset the scorer served: names the default --topic and, for bare Avro/Protobuf "
                         "predictions (no registry), the columns (its classes and label)", "group": _READ},
        # a reader takes what comes unless told: Arrow and JSON messages tell themselves apart
        predictions_format={"default": "auto", "help": "the scorer's --predictions-format: auto reads Arrow and JSON "
                                                       "messages; avro and protobuf need --schema-registry (the "
                                                       "scorer's) or --dataset", "group": _READ})
@narrow(limit={"parse": at_least(1)},  # 0 predictions: nothing to read
        out={"parse": store_path("--out", remote=False)}, dataset={"parse": store_path("--dataset", remote=False)})
class PredictionsJob(Dataset, PredictionsFormat, Limit, Out, Topic, IdColumn, SchemaRegistryOption, Overwrite, KafkaOptions):
    """The options of ``flowtrain predictions``."""

    follow: bool = option(False, "after the topic's end, keep reading new predictions as they come (each written "
                          "as it arrives) until Ctrl-C or SIGTERM", group=_READ)
