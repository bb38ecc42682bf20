"""What every part of ``flowtrain stream`` (the feature pipeline, the online trainer, the scorer) reads
before it starts: the ``--dataset`` and its manifest, the domain's enrichment step, the raw topic's
partitions. One module both ``flowtrain.cli.stream`` and ``flowtrain.cli.score`` import."""
from __future__ import annotations

from pathlib import Path

#: The dataset the stream reads when ``--dataset`` is not given: the flights demo's.
DEMO_DATASET = "runs/demo/dataset"


def dataset_path(args) -> str:
    """``--dataset`` (default the flights demo's) as an absolute path; not a dataset: a one-line exit."""
    path = Path(args.dataset or DEMO_DATASET)
    if not (path / "_manifest.json").exists():
        raise SystemExit(f"flowtrain stream: --dataset {path} is not a flowtrain dataset (no _manifest.json); the "
                         f"stream reads its spec and statistics. Make one with `flowtrain batch --out DIR` and pass "
                         f"--dataset DIR/dataset")
    return str(path.resolve())


def stream_manifest(args) -> dict:
    """The --dataset's manifest, which must hold the spec and statistics the stream reads."""
    from connectors.dataset import read_manifest

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
    """--enrichment: the flights' weather/planes join for the flights dataset (auto), or none."""
    from pipelines.flights.streaming import FlightReference, is_flights_dataset

    if args.enrichment == "none" or (args.enrichment == "auto" and not is_flights_dataset(manifest)):
        return None
    from flowtrain.local.paths import demo_tables_dir
    from pipelines.flights.batch import export_tables

    tables = export_tables(demo_tables_dir())
    return FlightReference(tables["weather"], tables["planes"])


def raw_partitions(bootstrap: str, topic: str, cfg: dict) -> int:
    """The partition count of ``topic``; a missing topic is a one-line exit naming `flowtrain replay`."""
    from connectors.kafka import close_client, new_consumer

    consumer = new_consumer(bootstrap, cfg, group_id=None)
    try:
        parts = consumer.partitions_for_topic(topic)
    finally:
        close_client(consumer)
    if not parts:
        raise SystemExit(f"flowtrain stream: raw topic {topic!r} does not exist on {bootstrap}; "
                         f"produce events first (flowtrain replay --topic {topic})")
    return len(parts)
