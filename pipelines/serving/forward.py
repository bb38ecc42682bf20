"""The forward of a flowtrain tabular model over featurized Arrow rows, without Beam: the one code the stream
scorer's and ``flowtrain predict``'s model handler (``pipelines.serving.handler``) and a loaded bundle's
``predict`` (in process, where no Beam is imported) run, so all three give the same numbers.

Inputs: the ``num__<col>`` (float32) and ``cat__<col>`` (int64 codes) columns of the spec, in the spec's order.
Outputs: binary classification, the probability of the positive class; K classes, the (rows, K) class
probabilities; regression, the value in the label's units (the model predicts the standardized target:
``value * scale + shift``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from connectors.dataset_spec import CAT_PREFIX, ID_PREFIX, NUM_PREFIX, FeatureSpec

__all__ = ["forward"]


def _stack(table: pa.Table | pa.RecordBatch, names: list[str], dtype) -> np.ndarray:
    if not names:
        return np.zeros((table.num_rows, 0), dtype=dtype)
    return np.ascontiguousarray(np.stack([table.column(c).to_numpy() for c in names], axis=1).astype(dtype))


def forward(module: Any, table: pa.Table | pa.RecordBatch, spec: FeatureSpec, *, n_classes: int,
            target_scale: tuple[float, float] = (0.0, 1.0), device: str = "cpu", what: str = "the model") -> np.ndarray:
    """``module`` (a torch module in eval mode, on ``device``) over the featurized rows of ``table``; see the
    module doc for the outputs. A model whose outputs do not fit the task is a ``ValueError`` naming ``what``."""
    import torch

    k = n_classes if spec.task == "classification" else 1
    if table.num_rows == 0:
        return np.zeros((0, k) if k > 2 else 0, dtype=np.float32)
    x_num = _stack(table, [NUM_PREFIX + c for c in spec.all_numeric], np.float32)
    # ID columns' keys after the category codes, as the training loader stacks them
    x_cat = _stack(table, [CAT_PREFIX + c for c in spec.categorical] + [ID_PREFIX + c for c in spec.id_columns],
                   np.int64)
    shift, scale = target_scale
    with torch.inference_mode():
        out = module(torch.from_numpy(x_num).to(device), torch.from_numpy(x_cat).to(device))
        want = (table.num_rows, k) if k > 2 else (table.num_rows,)
        if tuple(out.shape) != want:
            raise ValueError(f"{what} gives outputs of shape {tuple(out.shape)}; this dataset's task needs {want}")
        if spec.task == "regression":
            out = out * scale + shift  # in the label's units
        else:
            out = torch.softmax(out, dim=1) if k > 2 else torch.sigmoid(out)
        return out.float().cpu().numpy()
