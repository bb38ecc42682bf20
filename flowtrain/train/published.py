"""Published model versions: a trainer's checkpoint back into the model that can serve.

The online trainer publishes a version as a checkpoint file (``checkpoint.save``: SHA-256 beside
it; ``{"model": state_dict, "architecture": {...}, "version": N, ...}``) plus a record on the
model-updates topic. ``LoadPublishedVersion`` turns such a checkpoint into the model it holds,
built exactly as the trainer builds it (``Architecture.build`` on the batch dataset), in eval
mode, with its version. The checksum is verified and the weights load strictly, so a torn,
corrupted or mismatched file is an error that says why. It is a plain picklable callable: the
scoring pipeline (which may not import flowtrain) receives it as ``load_version``.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from flowtrain.train import checkpoint


class LoadPublishedVersion:
    """``path -> (model in eval mode, version)`` for the models trained on ``dataset``."""

    def __init__(self, dataset: str | Path):
        self.dataset = str(dataset)
        self._data = None

    def __getstate__(self):
        return {"dataset": self.dataset}

    def __setstate__(self, state):
        self.__init__(state["dataset"])

    @property
    def data(self):
        if self._data is None:
            from flowtrain.train.loader import TabularDataset

            self._data = TabularDataset(self.dataset)
        return self._data

    def __call__(self, path: str) -> tuple[torch.nn.Module, int]:
        from flowtrain.train.stream import Architecture

        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {path} does not exist (removed, or not on this machine's "
                                    f"filesystem)")
        state = checkpoint.load(path)  # raises if the checksum does not match
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "version" not in state:
            raise ValueError(f"checkpoint {path} holds no 'model' and 'version': not a published model version")
        if not isinstance(state.get("architecture"), dict):
            raise ValueError(f"checkpoint {path} holds no 'architecture' (kind, hidden sizes): cannot rebuild its "
                             f"model; publish it with the online trainer (flowtrain stream train)")
        model = Architecture.from_dict(state["architecture"], f"checkpoint {path}").build(self.data)
        model.load_state_dict(state["model"], strict=True)
        model.requires_grad_(False)
        model.eval()
        return model, int(state["version"])
