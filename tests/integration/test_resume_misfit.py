"""Issue 44 item 10: ``flowtrain batch --resume`` from a checkpoint of another shape (its checksum valid: resealed
as anyone can) is one line naming the checkpoint and the fix, exit status 2, ``run.json`` failed; it printed a
raw ``RuntimeError`` traceback ("size mismatch for ...")."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def test_item10_resume_from_a_checkpoint_of_another_shape_is_one_line(tmp_path, capsys):
    from flowtrain.cli.main import main

    csv = tmp_path / "d.csv"
    csv.write_text("a,c,y\n" + "".join(f"{i / 300:.4f},{'xyz'[i % 3]},{i % 2}\n" for i in range(300)))
    out = tmp_path / "run"
    args = ["batch", "--input", str(csv), "--label", "y", "--numeric", "a", "--categorical", "c", "--hidden", "8",
            "--threads", "1", "--no-progress", "--out", str(out)]
    assert main([*args, "--steps", "10"]) == 0
    newest = sorted((out / "checkpoints").glob("ckpt-*.pt"))[-1]
    state = torch.load(newest, weights_only=True)
    name, weight = next((k, v) for k, v in state["model"].items() if v.dim() == 2 and v.shape[0] == 8)
    state["model"][name] = torch.zeros(9, *weight.shape[1:])  # another model's layer
    torch.save(state, newest)
    sidecar = newest.with_suffix(".sha256")
    record = json.loads(sidecar.read_text())
    record["sha256"] = hashlib.sha256(newest.read_bytes()).hexdigest()
    sidecar.write_text(json.dumps(record))
    capsys.readouterr()
    assert main([*args, "--steps", "20", "--resume"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("WARNING:root:apitools")]
    assert len(err) == 1, err
    assert err[0].startswith(f"flowtrain batch: --resume: {newest} does not fit this run's model (size mismatch for "
                             f"{name}: copying a param with shape torch.Size([9, ") and \
        err[0].endswith("restore the run's own checkpoint, or start the run over with --overwrite"), err[0]
    marker = json.loads((out / "run.json").read_text())
    assert marker["status"] == "failed" and marker["error"].startswith("--resume: ")
