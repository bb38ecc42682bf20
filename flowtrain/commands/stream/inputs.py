"""What every part of ``flowtrain stream`` (the feature pipeline, the online trainer, the scorer) reads
before it starts: the ``--dataset`` and its manifest, the domain's enrichment step, the raw topic's
partitions. One module every part of the job imports."""
from __future__ import annotations

from pathlib import Path

from connectors.dataset import read_manifest
from connectors.kafka import (
    DEFAULT_CONNECT_TIMEOUT_S,
    KafkaUnavailable,
    close_client,
    new_consumer,
    topic_partitions,
)
from flowtrain.local.paths import cache_root
from pipelines.features.declare import DeclarationError, declare
from pipelines.presets import get_preset, preset_for

#: The dataset the stream reads when ``--dataset`` is not given: the default preset's (``make demo`` makes it).
DEMO_DATASET = "runs/demo/dataset"


def dataset_path(args) -> str:
    """``--dataset`` (default the demo's) as an absolute path; not a dataset: a one-line exit."""
    path = Path(args.dataset or DEMO_DATASET)
    if not (path / "_manifest.json").exists():
        raise SystemExit(f"flowtrain stream: --dataset {path} is not a flowtrain dataset (no _manifest.json); the "
                         f"stream reads its spec and statistics. Make one with `flowtrain batch --out DIR` and pass "
                         f"--dataset DIR/dataset")
    return str(path.resolve())


def stream_manifest(args) -> dict:
    """The --dataset's manifest, which must hold the spec and statistics the stream reads."""
    dataset = dataset_path(args)
    try:
        manifest = read_manifest(dataset)
    except Exception as err:  # noqa: BLE001 - an unreadable or foreign manifest: one line, exit 2
        raise SystemExit(f"flowtrain stream: --dataset {dataset} is not a flowtrain dataset "
                         f"({type(err).__name__}: {str(err)[:200]}); make one with `flowtrain batch`") from None
    if not isinstance(manifest.get("spec"), dict) or not isinstance(manifest.get("stats"), dict):
        raise SystemExit(f"flowtrain stream: --dataset {dataset}: its manifest has no spec or statistics; "
                         f"make the dataset again with `flowtrain batch`")
    return manifest


def enrichment(args, manifest: dict):
    """--enrichment: the enrichment of the dataset's preset (auto), of the preset named, or none; a dataset of
    your own files has none (``pipelines.presets``)."""
    if args.enrichment == "none":
        return None
    try:
        preset = preset_for(manifest) if args.enrichment == "auto" else get_preset(args.enrichment)
    except ValueError as err:
        raise SystemExit(f"flowtrain stream: --enrichment {args.enrichment}: {err}") from None
    if preset is None or preset.enrichment is None:
        if args.enrichment != "auto":
            raise SystemExit(f"flowtrain stream: --enrichment {args.enrichment}: that dataset preset has no stream "
                             f"enrichment; give --enrichment none or auto")
        return None
    return preset.enrichment(preset.demo_inputs(cache_root()))


def raw_partitions(bootstrap: str, topic: str, cfg: dict) -> int:
    """The partition count of ``topic``; a missing topic is a one-line exit naming `flowtrain replay`."""
    consumer = new_consumer(bootstrap, cfg, group_id=None)
    try:
        parts = topic_partitions(consumer, topic, timeout_s=DEFAULT_CONNECT_TIMEOUT_S)
    except KafkaUnavailable as err:
        raise SystemExit(f"flowtrain stream: the partitions of raw topic {topic!r}: {err}") from None
    finally:
        close_client(consumer)
    if not parts:
        raise SystemExit(f"flowtrain stream: raw topic {topic!r} does not exist on {bootstrap}; "
                         f"produce events first (flowtrain replay --topic {topic})")
    return len(parts)


def over_time(options: dict, manifest: dict, dataset: str) -> dict:
    """The stream part's ``--aggregate``/``--join`` (in ``options``): as given, else those the dataset was made
    with (its manifest's ``features``, recorded by ``flowtrain batch --aggregate``): declared once, in training.
    Given ones must make the columns the model was trained on (the same aggregates; joins on the same keys, their
    tables may be newer files); otherwise a one-line exit."""
    recorded = manifest.get("features") or {}
    given = bool(options.get("aggregations") or options.get("joins"))
    if not given:
        return {**options, "aggregations": tuple(recorded.get("aggregations") or ()),
                "joins": tuple(recorded.get("joins") or ())}
    if not recorded:
        return options
    try:
        mine = declare(options.get("aggregations") or (), options.get("joins") or ())
        theirs = declare(recorded.get("aggregations") or (), recorded.get("joins") or ())
    except DeclarationError as err:
        raise SystemExit(f"flowtrain stream: {err}") from None
    if mine.aggregate_names() != theirs.aggregate_names() or \
            [(j.key, j.valid_from) for j in mine.joins] != [(j.key, j.valid_from) for j in theirs.joins]:
        shown = " ".join([*(f"--aggregate {a}" for a in recorded.get("aggregations") or ()),
                          *(f"--join {j}" for j in recorded.get("joins") or ())])
        raise SystemExit(f"flowtrain stream: --aggregate/--join differ from those dataset {dataset} was made with "
                         f"({shown}): the model takes those columns; leave the options out to use the dataset's")
    return options
