"""Issue 33 item 4: write-then-mark on stores without rename (flowtrain.train.staging), on fsspec's in-memory
filesystem: a directory's marker after its files, ``run.json`` last (or first, while a run starts), deletions only
of what the pull saw and the local rules removed, never a link's target."""
from __future__ import annotations

import uuid

import fsspec

from flowtrain.train.staging import _publish_order, fetch_inputs, staged_dir, staged_outputs


def test_item4_publish_order_markers_last():
    order = _publish_order(["run.json", "bundle/bundle.json", "bundle/model.safetensors", "dataset/_manifest.json",
                            "dataset/part-0.parquet", "checkpoints/ckpt-000000004.sha256",
                            "checkpoints/ckpt-000000004.pt", "model.pt"])
    assert order[-1] == "run.json"
    assert order.index("bundle/bundle.json") > order.index("bundle/model.safetensors")
    assert order.index("dataset/_manifest.json") > order.index("dataset/part-0.parquet")
    assert order.index("checkpoints/ckpt-000000004.sha256") > order.index("checkpoints/ckpt-000000004.pt")


def test_item4_staged_push_write_then_mark_and_deletes_only_what_was_removed(tmp_path):
    fs = fsspec.filesystem("memory")
    root = f"/flowtrain-{uuid.uuid4().hex[:8]}/run"
    fs.pipe_file(f"{root}/run.json", b'{"old": 1}')
    fs.pipe_file(f"{root}/model.pt", b"old weights")
    fs.pipe_file(f"{root}/theirs/notes.txt", b"someone else's")
    written: list[str] = []
    put = fs.put_file

    def recording_put(lpath, rpath, **kw):
        written.append(rpath.split(root + "/", 1)[1])
        return put(lpath, rpath, **kw)

    with staged_dir(f"memory://{root}", "--out") as stage:
        fs.put_file = recording_put  # the real filesystem writes; the order is recorded
        assert (stage.local / "model.pt").read_bytes() == b"old weights"
        (stage.local / "model.pt").unlink()  # as the run-directory rules delete an earlier run's file
        (stage.local / "run.json").write_text('{"status": "running"}')
        stage.push(marker_first=True)
        assert written == ["run.json"] and not fs.exists(f"{root}/model.pt")
        for rel, data in {"bundle/model.safetensors": "w", "bundle/bundle.json": "{}", "dataset/part-0.parquet": "p",
                          "dataset/_manifest.json": "{}"}.items():
            (stage.local / rel).parent.mkdir(parents=True, exist_ok=True)
            (stage.local / rel).write_text(data)
        outside = tmp_path / "outside.txt"
        outside.write_text("not the run's")
        (stage.local / "linked.txt").symlink_to(outside)  # a link is never published
        (stage.local / "run.json").write_text('{"status": "complete"}')
        written.clear()
        stage.push()
        fs.put_file = put
    assert written[-1] == "run.json"
    assert written.index("bundle/bundle.json") > written.index("bundle/model.safetensors")
    assert written.index("dataset/_manifest.json") > written.index("dataset/part-0.parquet")
    assert "linked.txt" not in written and not fs.exists(f"{root}/linked.txt")
    assert fs.cat_file(f"{root}/theirs/notes.txt") == b"someone else's"
    assert fs.cat_file(f"{root}/run.json") == b'{"status": "complete"}'


def test_item4_inputs_and_outputs_on_a_store(tmp_path):
    fs = fsspec.filesystem("memory")
    root = f"/flowtrain-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{root}/in/a.csv", b"x\n1\n")
    fs.pipe_file(f"{root}/in/b.csv", b"x\n2\n")
    got = fetch_inputs([f"memory://{root}/in/*.csv", str(tmp_path / "local.csv")])
    assert [p.rsplit("/", 1)[1] for p in got] == ["a.csv", "b.csv", "local.csv"]
    with staged_outputs({"--out": f"memory://{root}/out/p.csv", "metrics": f"memory://{root}/out/p.csv.m"},
                        overwrite=False, last="metrics") as local:
        assert local["metrics"] == local["--out"] + ".m"  # sidecars stay side by side
        for path in local.values():
            open(path, "w").write("done")
    assert fs.cat_file(f"{root}/out/p.csv") == b"done" and fs.exists(f"{root}/out/p.csv.m")
    try:
        with staged_outputs({"--out": f"memory://{root}/out/p.csv"}, overwrite=False):
            raise AssertionError("an existing output must be refused")
    except ValueError as err:
        assert "exists" in str(err) and "--overwrite" in str(err)


def test_item4_checkpoints_published_while_training(tmp_path):
    """A run killed mid-training resumes from the store: its checkpoints are published as they are written
    (the ``.pt`` before its ``.sha256``; pruned ones deleted there too), nothing else before the end."""
    import time

    fs = fsspec.filesystem("memory")
    root = f"/flowtrain-{uuid.uuid4().hex[:8]}/run"
    with staged_dir(f"memory://{root}", "--out") as stage:
        stage.local.mkdir(parents=True)
        (stage.local / "run.json").write_text('{"status": "running"}')
        stage.push(marker_first=True)
        stage.start_publishing("checkpoints/", every_s=0.05)
        ckpts = stage.local / "checkpoints"
        ckpts.mkdir()
        (ckpts / "ckpt-000000002.pt").write_bytes(b"state 2")
        (ckpts / "ckpt-000000002.sha256").write_text("sum 2")
        (stage.local / "model.pt").write_bytes(b"best")
        deadline = time.monotonic() + 60
        while not fs.exists(f"{root}/checkpoints/ckpt-000000002.sha256") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fs.cat_file(f"{root}/checkpoints/ckpt-000000002.pt") == b"state 2"
        (ckpts / "ckpt-000000002.pt").unlink()  # pruned by the run
        (ckpts / "ckpt-000000002.sha256").unlink()
        while fs.exists(f"{root}/checkpoints/ckpt-000000002.pt") and time.monotonic() < deadline:
            time.sleep(0.05)
        stage.stop_publishing()
        assert not fs.exists(f"{root}/checkpoints/ckpt-000000002.pt")
        assert not fs.exists(f"{root}/model.pt")  # the rest waits for the final publish
        assert fs.cat_file(f"{root}/run.json") == b'{"status": "running"}'
