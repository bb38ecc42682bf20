"""The online trainer: consumes feature batches from Kafka and trains, exactly once.

For each feature message (one Arrow record batch, in offset order per partition) it first
evaluates the current model on the rows, then trains on them (prequential metrics). Every K
steps or T seconds it writes a checkpoint holding the model, the optimizer, the step, the RNG,
every replica's Kafka positions *and* the seen-source state, then publishes the model version
(the checkpoint plus a record on the model-updates topic).

Exactly once: positions come only from the checkpoint, never from group commits, so after a
crash the trainer resumes exactly where the model it restores had got to: work after the
checkpoint is redone from the same state, nothing is lost and nothing counts twice. The
pipeline upstream is at least once (it may write a row again after its own crash); each row
carries its source (raw partition, offset), and since the pipeline writes a raw partition's rows
in offset order to one feature partition, the seen-source state is one number per raw partition
(the highest offset trained): bounded, and inside the checkpoint.
"""
from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from connectors.arrow import decode_batch
from connectors.kafka import ensure_topic, retry_kafka
from flowtrain.train import checkpoint
from flowtrain.train.loader import TabularDataset, table_to_split
from flowtrain.train.metrics import MetricsLog, auc
from flowtrain.train.model import TabularMLP
from flowtrain.parallel import DistContext, make_reducer, sum_loss


@dataclass
class StreamTrainConfig:
    bootstrap: str
    run_dir: str
    dataset: str  # the batch dataset: feature spec, statistics, vocabularies
    features_topic: str = "flights-features"
    updates_topic: str = "flights-model-updates"
    init_weights: str | None = None  # a batch run's model.pt to start from
    lr: float = 1e-3
    hidden: tuple[int, ...] = (128, 64)
    dropout: float = 0.0
    seed: int = 0
    checkpoint_every_steps: int = 50
    checkpoint_every_s: float = 10.0
    idle_exit_s: float | None = None  # stop (with a final checkpoint) after this long without data
    max_steps: int | None = None
    ledger: bool = False  # test hook: trained sources, per checkpoint version, in ledger.jsonl
    kafka_config: dict[str, Any] = field(default_factory=dict)


class _Stop(Exception):
    pass


def _split_of(batch: pa.RecordBatch, spec) -> tuple:
    table = pa.Table.from_batches([batch])
    split = table_to_split(table, spec)
    return split, batch.column("src_partition").to_numpy(), batch.column("src_offset").to_numpy()


def run_stream_trainer(cfg: StreamTrainConfig, ctx: DistContext | None = None) -> dict:
    """Train until stopped (SIGINT/SIGTERM, ``idle_exit_s``, ``max_steps``); returns a summary."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    ctx = ctx or DistContext()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = run_dir / "checkpoints"
    data = TabularDataset(cfg.dataset)
    spec = data.spec
    torch.manual_seed(cfg.seed)  # the same initial weights in every run (and on every replica)
    model = TabularMLP(data.n_numeric, data.cardinalities, hidden=cfg.hidden, dropout=cfg.dropout)
    if cfg.init_weights:
        model.load_state_dict(torch.load(cfg.init_weights, weights_only=True))
    reducer = make_reducer(model, ctx)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    loss_fn = nn.BCEWithLogitsLoss() if spec.task == "classification" else nn.MSELoss()

    consumer = KafkaConsumer(bootstrap_servers=cfg.bootstrap, group_id=None, enable_auto_commit=False,
                             max_poll_records=1, fetch_max_wait_ms=100, max_partition_fetch_bytes=16 * 1024 * 1024,
                             **cfg.kafka_config)
    parts = sorted(consumer.partitions_for_topic(cfg.features_topic) or [])
    deadline = time.monotonic() + 30
    while not parts and time.monotonic() < deadline:
        time.sleep(0.5)
        parts = sorted(consumer.partitions_for_topic(cfg.features_topic) or [])
    if not parts:
        raise ValueError(f"features topic {cfg.features_topic!r} does not exist on {cfg.bootstrap}; start the "
                         f"stream pipeline first (flowtrain stream pipeline)")
    mine = [TopicPartition(cfg.features_topic, p) for p in parts if p % ctx.world_size == ctx.rank]
    consumer.assign(mine)

    # --- state: from the last checkpoint only ---------------------------------------------------
    step, version = 0, 0
    positions: dict[int, int] = {}  # feature partition -> next offset
    seen: dict[int, int] = {}  # raw partition -> highest raw offset trained
    latest = checkpoint.latest(ckpt_dir)
    if latest is not None:
        state = checkpoint.load(latest)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, version = int(state["step"]), int(state["version"])
        positions = {int(k): int(v) for k, v in state["positions"].items()}
        seen = {int(k): int(v) for k, v in state["seen"].items()}
        if ctx.is_main:
            print(f"stream train: resumed from {latest.name} (version {version}, step {step}, positions "
                  f"{positions})", flush=True)
    for tp in mine:
        if tp.partition in positions:
            consumer.seek(tp, positions[tp.partition])
        else:
            consumer.seek_to_beginning(tp)
    ledger_path = run_dir / "ledger.jsonl"
    if cfg.ledger and ledger_path.exists():  # drop what belongs to checkpoints newer than the one restored
        kept = [line for line in ledger_path.read_text().splitlines() if json.loads(line)["version"] <= version]
        ledger_path.write_text("".join(line + "\n" for line in kept))
    log = MetricsLog(run_dir / "metrics.jsonl")
    if ctx.is_main and log.path.exists():
        log.truncate_after(step)
    producer = None
    if ctx.is_main:
        ensure_topic(cfg.bootstrap, cfg.updates_topic, client_config=cfg.kafka_config)
        producer = KafkaProducer(bootstrap_servers=cfg.bootstrap, acks="all", **cfg.kafka_config)

    stop = {"now": False}

    def on_signal(signum, _frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    pending_ledger: list[tuple[int, int]] = []
    window: list[tuple[np.ndarray, np.ndarray]] = []  # prequential (scores, labels) since the last log
    rows_trained = dropped = 0
    last_ckpt_t = last_data_t = last_status_t = time.monotonic()
    first_data_t = None
    last_loss = None
    steps_since_ckpt = 0

    def save(reason: str) -> None:
        nonlocal version, last_ckpt_t, steps_since_ckpt
        version += 1
        all_positions = _gather_dict(ctx, positions)
        all_seen = _gather_dict(ctx, seen)
        preq = _prequential(window)
        if cfg.ledger:
            lines = _gather_list(ctx, pending_ledger)
            if ctx.is_main and lines:
                with open(ledger_path, "a") as fh:
                    for p, o in lines:
                        fh.write(json.dumps({"version": version, "partition": int(p), "offset": int(o)}) + "\n")
        if ctx.is_main:
            path = checkpoint.save(ckpt_dir, step, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                "step": step, "version": version, "positions": {str(k): v for k, v in all_positions.items()},
                "seen": {str(k): v for k, v in all_seen.items()}}, keep=3)
            log.write({"kind": "prequential", "step": step, "version": version, "rows": rows_trained, **preq})
            record = {"version": version, "step": step, "checkpoint": str(path), "positions": all_positions,
                      "metrics": preq, "reason": reason, "time": time.time()}
            producer.send(cfg.updates_topic, key=str(version).encode(), value=json.dumps(record).encode())
            retry_kafka(lambda: producer.flush(timeout=30), "publishing a model version")
            _plot(log, run_dir)
            _status(run_dir, {"step": step, "version": version, "rows": rows_trained, "dropped_duplicates": dropped,
                              "loss": preq.get("loss"), "positions": all_positions})
        pending_ledger.clear()
        window.clear()
        last_ckpt_t, steps_since_ckpt = time.monotonic(), 0

    try:
        while True:
            # --- one step: at most one feature message per replica ----------------------------
            polled = consumer.poll(timeout_ms=200)
            msg = next((m for records in polled.values() for m in records), None)
            local = None
            if msg is not None:
                last_data_t = time.monotonic()
                first_data_t = first_data_t or last_data_t
                positions[msg.partition] = msg.offset + 1
                batch = decode_batch(msg.value)
                split, src_p, src_o = _split_of(batch, spec)
                fresh = _unseen(src_p, src_o, seen)
                dropped += int((~fresh).sum())
                if fresh.any():
                    idx = torch.from_numpy(np.flatnonzero(fresh))
                    local = (split.take(idx), src_p[fresh], src_o[fresh])
            flags = torch.tensor([1.0 if local is not None else 0.0, 1.0 if stop["now"] else 0.0])
            if ctx.distributed:
                import torch.distributed as dist

                dist.all_reduce(flags)
            anyone_has_data, anyone_stops = flags[0] > 0, flags[1] > 0
            if anyone_has_data:
                loss_sum, n_local = None, 0
                if local is not None:
                    b, bp, bo = local
                    model.eval()
                    with torch.no_grad():  # evaluate first (prequential), then train
                        window.append((model(b.x_num, b.x_cat).numpy(), b.y.numpy()))
                    model.train()
                    torch.manual_seed(cfg.seed * 1_000_003 + step * 1009 + ctx.rank)
                    loss_sum, n_local = sum_loss(loss_fn, model(b.x_num, b.x_cat), b.y), len(b)
                    for p in np.unique(bp):  # a column at a time: one max per raw partition
                        seen[int(p)] = max(seen.get(int(p), -1), int(bo[bp == p].max()))
                    if cfg.ledger:
                        pending_ledger.extend(zip(bp.tolist(), bo.tolist()))
                optimizer.zero_grad(set_to_none=True)
                global_n, last_loss = reducer.backward(loss_sum, n_local)
                if global_n:
                    optimizer.step()
                    step += 1
                    steps_since_ckpt += 1
                    rows_trained += n_local
            idle = time.monotonic() - last_data_t
            if anyone_stops or (cfg.max_steps and step >= cfg.max_steps) or \
                    (cfg.idle_exit_s is not None and idle >= cfg.idle_exit_s and not anyone_has_data):
                save("final")
                break
            if ctx.is_main and time.monotonic() - last_status_t >= 1.0:
                last_status_t = time.monotonic()
                _status(run_dir, {"step": step, "version": version, "rows": rows_trained,
                                  "dropped_duplicates": dropped, "loss": last_loss, "positions": positions})
            if steps_since_ckpt and (steps_since_ckpt >= cfg.checkpoint_every_steps
                                     or time.monotonic() - last_ckpt_t >= cfg.checkpoint_every_s):
                save("periodic")
    finally:
        consumer.close()
        if producer is not None:
            producer.close(timeout=10)
        reducer.close()
    busy = (last_data_t - first_data_t) if first_data_t else 0.0
    return {"step": step, "version": version, "rows": rows_trained, "dropped_duplicates": dropped,
            "rows_per_s": rows_trained / busy if busy > 0 else 0.0}


def _prequential(window: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    if not window:
        return {}
    scores = torch.from_numpy(np.concatenate([s for s, _ in window]))
    labels = torch.from_numpy(np.concatenate([y for _, y in window]))
    loss = float(nn.functional.binary_cross_entropy_with_logits(scores.double(), labels.double()))
    out = {"loss": loss, "rows": int(labels.numel())}
    value = auc(scores, labels)
    if not math.isnan(value):
        out["auc"] = value
    return out


def _unseen(partitions: np.ndarray, offsets: np.ndarray, seen: dict[int, int]) -> np.ndarray:
    """Rows whose source is past the highest offset already trained for its raw partition."""
    fresh = np.ones(len(offsets), dtype=bool)
    for p in np.unique(partitions):
        rows = partitions == p
        fresh[rows] = offsets[rows] > seen.get(int(p), -1)
    return fresh


def _gather(ctx: DistContext, mine) -> list:
    """Every replica's ``mine`` (just ours without a process group)."""
    if not ctx.distributed:
        return [mine]
    import torch.distributed as dist

    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def _gather_dict(ctx: DistContext, mine: dict) -> dict:
    """Positions / seen offsets of all replicas: each key's highest value."""
    merged: dict = {}
    for d in _gather(ctx, dict(mine)):
        for k, v in d.items():
            merged[k] = max(v, merged.get(k, v))
    return merged


def _gather_list(ctx: DistContext, mine: list) -> list:
    return [x for part in _gather(ctx, list(mine)) for x in part]


def _plot(log: MetricsLog, run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in log.read() if r.get("kind") == "prequential" and "loss" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], "o-", label="prequential loss")
    if any("auc" in r for r in rows):
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in rows if "auc" in r], [r["auc"] for r in rows if "auc" in r], "s--",
                 color="tab:orange", label="prequential AUC")
        ax2.set_ylabel("AUC")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("online training (evaluate, then train, per batch)")
    fig.tight_layout()
    tmp = run_dir / "prequential.png.tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(run_dir / "prequential.png")


def _status(run_dir: Path, status: dict) -> None:
    tmp = run_dir / "trainer-status.json.tmp"
    tmp.write_text(json.dumps({**status, "time": time.time()}, default=str))
    tmp.replace(run_dir / "trainer-status.json")
