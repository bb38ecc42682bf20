"""Bytes and time per published version of a model with an ID table, as the online trainer publishes it
(issue 32 item 3): a delta (the dense parameters + only the ID rows touched since the previous version)
against a full snapshot and against the whole torch checkpoint every version was before deltas.

A table of ``--ids`` rows at ``--dim`` (SGD: the published rows are the same with Adam; the whole
checkpoint would also carry Adam's moments), ``--touched`` of the rows updated between versions. Each
repeat, interleaved:

* ``delta``: ``IdPublisher.publish`` + ``Publisher.publish_ids`` (the payload file written, its record
  signed): payload and record bytes, the trainer's seconds;
* ``snapshot``: the same for a full snapshot (every ``--snapshot-every`` versions);
* ``whole checkpoint``: ``Publisher.publish`` of the model's ``state_dict`` (the table inside), as
  every version was published before (the anchor);
* the scorer (``pipelines.ids.serving.ServedIds``): seconds to verify and apply the delta on top of its
  base, to apply the snapshot, and to encode its own whole copy of the served version (what its model
  handler loads: ``VersionTracker``).

Medians of ``--repeats`` runs (bench.timing), one process, one thread.

    flowtrain bench ids-publish --ids 1000000 --dim 16 --touched 0.01 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench.timing import MIN_REPEATS, check_repeats, interleaved, median, repeats_note
from connectors.id_deltas import encode
from flowtrain.train.ids import IdEmbedding
from flowtrain.train.ids.publish import IdPublisher
from flowtrain.train.published import Publisher
from pipelines.ids.serving import ServedIds


class _Key:
    def load(self) -> bytes:
        return b"bench-update-key-0123456789abcdef"


def run(ids: int = 1_000_000, dim: int = 16, touched: float = 0.01, repeats: int = MIN_REPEATS,
        seed: int = 0) -> dict:
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    model = nn.Module()
    model.user = IdEmbedding(dim, optimizer="sgd", capacity=ids)
    model.user.table.observe(np.arange(ids, dtype=np.int64))
    model.head = nn.Linear(dim, 1)
    n = max(1, int(ids * touched))
    info = {"architecture": json.dumps({"kind": "bench"})}
    work = Path(tempfile.mkdtemp(prefix="flowtrain-bench-ids-publish-"))
    pub = Publisher(work, keep=2, key_source=_Key())
    ids_pub = IdPublisher(model, snapshot_every=10 ** 9)
    version = [0]

    def publish(snapshot: bool) -> dict:
        if snapshot:
            ids_pub.previous = None  # the next version is a snapshot
        version[0] += 1
        t0 = time.perf_counter()
        payload, meta = ids_pub.publish(version[0], info)
        record = pub.publish_ids(payload, meta, step=version[0], run_id="bench")
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "payload": len(payload), "record": len(json.dumps(record)),
                "rows": len(meta.tables["user"].keys), "data": payload, "rec": record}

    state = {}

    def delta_case() -> dict:
        if "served" not in state:  # the scorer's base: a snapshot applied
            base = publish(snapshot=True)
            state["served"] = ServedIds(_Key().load())
            state["served"].offer(base["rec"], base["data"])
        rows = rng.choice(ids, size=n, replace=False)
        model.user.table.apply_gradients(rows, torch.ones(n, dim), 0.01)
        out = publish(snapshot=False)
        served = state["served"]
        t0 = time.perf_counter()
        assert served.offer(out["rec"], out["data"]) == "applied"
        out["apply_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        copy = encode(served.snapshot())
        out["copy_s"], out["copy_bytes"] = time.perf_counter() - t0, len(copy)
        return out

    def snapshot_case() -> dict:
        out = publish(snapshot=True)
        fresh = ServedIds(_Key().load())
        t0 = time.perf_counter()
        assert fresh.offer(out["rec"], out["data"]) == "applied"
        out["apply_s"] = time.perf_counter() - t0
        state["served"] = fresh  # the next delta's base
        return out

    def whole_case() -> dict:
        version[0] += 1
        t0 = time.perf_counter()
        record = pub.publish(model={k: v.detach() for k, v in model.state_dict().items()}, architecture={},
                             version=version[0], step=version[0], run_id="bench")
        return {"seconds": time.perf_counter() - t0, "payload": record["bytes"], "record": len(json.dumps(record)),
                "rows": ids}

    try:
        runs = interleaved({"delta": delta_case, "snapshot": snapshot_case, "whole checkpoint": whole_case},
                           repeats=repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"ids": ids, "dim": dim, "touched": touched, "repeats": repeats, "cases": {}}
    for name, results in runs.items():
        case = {k: median(results, key=lambda r, k=k: r[k]) for k in ("seconds", "payload", "record", "rows")}
        for k in ("apply_s", "copy_s", "copy_bytes"):
            if k in results[0]:
                case[k] = median(results, key=lambda r, k=k: r[k])
        out["cases"][name] = case
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--touched", type=float, default=0.01, help="fraction of the rows updated between versions")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS)
    args = ap.parse_args(argv)
    check_repeats(args.repeats)
    res = run(args.ids, args.dim, args.touched, args.repeats)
    c = res["cases"]
    print(f"ID table of {res['ids']:,} rows at dimension {res['dim']}, {res['touched']:.0%} of the rows touched "
          f"between versions; {repeats_note(res['repeats'])}, one process, one thread")
    print("| published version | ID rows | payload bytes | record bytes | trainer s | scorer applies, s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, label in (("delta", f"delta ({res['touched']:.0%} touched)"), ("snapshot", "snapshot"),
                        ("whole checkpoint", "whole checkpoint (anchor: every version before deltas)")):
        x = c[name]
        apply = f"{x['apply_s']:.3f}" if "apply_s" in x else "(loads the model)"
        print(f"| {label} | {int(x['rows']):,} | {int(x['payload']):,} | {int(x['record']):,} | {x['seconds']:.3f} | "
              f"{apply} |")
    d, w = c["delta"], c["whole checkpoint"]
    print(f"delta / whole checkpoint: {d['payload'] / w['payload']:.2%} of the bytes; the scorer's own whole copy of "
          f"the served version: {int(d['copy_bytes']):,} bytes encoded in {d['copy_s']:.3f} s per version (then written "
          f"and loaded by the scorer)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
