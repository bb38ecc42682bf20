"""A capped training worker imports what training imports lazily before its cap is calibrated (issue 49): after
``import_training`` an optimizer made and stepped, the evaluation's metrics, a TensorBoard writer and a DCP save
(``flowtrain.train.checkpoint``'s ``FileSystemWriter``) import nothing more. Under ``RLIMIT_AS`` a library loaded after the calibration spends the worker's allowance
(``torch._dynamo``, which an optimizer's first ``add_param_group`` imports, mapped ~245 MiB with triton)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from flowtrain.train.preload import import_training

    import_training()
    before = set(sys.modules)
    # what a training worker does after its cap: an optimizer, the evaluation, TensorBoard, a DCP save
    model = nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    from flowtrain.train.metrics import metrics_of
    metrics_of(torch.tensor([-1.0, 2.0, -0.5, 0.5]), torch.tensor([0.0, 1.0, 0.0, 1.0]), "binary", [0, 1])
    from flowtrain.observe.board import Board
    board = Board(sys.argv[1])
    board.scalars("train", {"loss": 1.0}, 0)
    board.close()
    from torch.distributed import checkpoint as dcp
    dcp.save({"w": model.weight.detach()}, storage_writer=dcp.FileSystemWriter(sys.argv[1] + "/ckpt"), no_dist=True)
    late = sorted(m for m in set(sys.modules) - before
                  if m.split(".")[0] in ("torch", "triton", "tensorboard", "scipy", "sklearn"))
    print("LATE", late)
""")


def test_import_training_leaves_nothing_to_import_later(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch._dynamo" in subprocess.run(
        [sys.executable, "-c", "import sys; from flowtrain.train.preload import import_training; import_training(); "
         "print(sorted(sys.modules))"], cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    late = next(line for line in out.stdout.splitlines() if line.startswith("LATE"))
    assert late == "LATE []", late
