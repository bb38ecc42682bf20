"""``FlowtrainModelHandler``: Beam ``RunInference``'s model handler for flowtrain's tabular models.

An example is a ``ScoringBatch`` (one micro-batch of featurized events as Arrow); RunInference
stacks up to ``max_batch_size`` of them and ``run_inference`` runs one forward over all their rows
(numerics and category codes taken a column at a time from Arrow, no per-row Python). The
inference per example is ``(outputs, scored_ms)``: for binary classification the probability of
the positive class, for K classes the (rows, K) class probabilities, for regression the value in
the label's units (the model predicts the standardized target: ``value * scale + shift``).
``PredictionResult.model_id`` is ``"<run id>:<version>"`` of the model that computed it.

Which version serves: before each forward the handler asks ``newest`` (``pipelines.serving.updates.NewestVersion``:
the newest valid version a reader thread in this worker process has found on the updates topic) and, when it
is newer than the model Beam handed over, loads it and scores with it. So every micro-batch scored more than
about one ``--swap-interval`` after a version was published carries it (or a newer one), whatever the event
times, the windows or the runner. (Beam's own path, a ``ModelMetadata`` side input of ``RunInference``, is
not used: on Prism a micro-batch whose serving window's side input was not complete yet was scored with an
empty side input, i.e. with the model loaded last, so a new version reached only the windows that happened to
see it — 300 of 300 events scored by v2 with v3 published, issue #42 — and a backlog stamped before the
first side-input tick stayed in the first window. ``update_model_path`` still takes a ``ModelVersion`` as
JSON for a caller that passes one.)

Per process the handler keeps the most recently *published* version it has loaded and never serves an earlier
one; a version it cannot load is logged while the newest loaded one keeps serving; and when nothing is loaded
yet and the version it names cannot be loaded (its copy pruned, a file gone), it falls back to the newest valid
copy in the scorer's model cache: a missing model never fails the job while any valid version exists.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from connectors.dataset_spec import FeatureSpec
from pipelines.serving.forward import forward
from pipelines.serving.versions import ModelCache, ModelVersion

__all__ = ["ServedModel", "FlowtrainModelHandler", "model_tag", "parse_model_tag"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ServedModel:
    """A loaded version (a plain class: Beam's ``shared.Shared`` holds it by weak reference)."""

    module: Any  # torch.nn.Module in eval mode
    version: ModelVersion


def model_tag(version: ModelVersion) -> str:
    """``PredictionResult.model_id``: ``"<run id>:<version>"``."""
    return f"{version.run_id}:{version.version}"


def parse_model_tag(tag: str) -> tuple[str, int]:
    run, version = str(tag).rsplit(":", 1)
    return run, int(version)


# Per process and handler: the versions loaded (path -> ServedModel) and the newest of them.
# _RunInferenceDoFn instances are per bundle processor; they share a process, so they share this.
_SERVED: dict[str, dict[str, ServedModel]] = {}
_NEWEST: dict[str, ServedModel] = {}
_SERVED_LOCK = threading.Lock()
# Per process and handler: why a wanted version could not be loaded (its path -> the reason), and the versions
# already warned about as announced but not serving.
_FAILED: dict[str, dict[str, str]] = {}
_WARNED: dict[str, set[str]] = {}


class FlowtrainModelHandler(ModelHandler[Any, PredictionResult, ServedModel]):
    """See the module doc. ``initial`` is the ``ModelVersion`` to serve before the first side input."""

    def __init__(self, load_version: Callable[..., tuple[Any, int]], initial: ModelVersion, spec: FeatureSpec, *,
                 cache_dir: str | None = None, device: str = "cpu", max_batch_size: int = 16,
                 target_scale: tuple[float, float] = (0.0, 1.0), n_classes: int = 2, torch_threads: int | None = 1,
                 newest: Callable[[], ModelVersion | None] | None = None, warn_after_s: float = 10.0):
        super().__init__(min_batch_size=1, max_batch_size=max_batch_size)
        self._load_version = load_version
        self._want = initial
        self._newest = newest  # the newest valid version this process has read (NewestVersion), or None
        self._warn_after_s = warn_after_s  # a version announced this long ago and not serving: a warning
        self._spec = spec
        self._cache_dir = cache_dir
        self._device = device
        self._shift, self._scale = target_scale  # regression: the model predicts the standardized target
        self._n_classes = n_classes
        self._threads = torch_threads
        self._token = uuid.uuid4().hex  # shared by the handler's copies in every DoFn instance

    def update_model_path(self, model_path: str | None = None):
        if model_path:
            self._want = ModelVersion.from_model_id(model_path)

    def _load(self, version: ModelVersion) -> ServedModel:
        module, loaded = self._load_version(version.path, version.sha256) if version.sha256 else \
            self._load_version(version.path)
        if int(loaded) != version.version:
            raise ValueError(f"{version.path} holds version {loaded}, not {version.version}")
        module.to(self._device)
        return ServedModel(module, version)

    def _fallback(self, err: Exception) -> ServedModel:
        """Nothing loaded yet and the wanted version cannot be: the newest valid copy in the cache."""
        for cand in ModelCache(self._cache_dir).listed() if self._cache_dir else []:
            try:
                served = self._load(cand)
            except Exception:  # noqa: BLE001 - the next older copy, then
                continue
            _log.warning("model version %d at %s cannot be loaded (%s: %s); serving version %d (%s), the newest valid "
                         "copy", self._want.version, self._want.path, type(err).__name__, err, cand.version, cand.path)
            return served
        raise RuntimeError(f"no model to serve: {self._want.path} cannot be loaded ({type(err).__name__}: {err}) and "
                           f"the model cache {self._cache_dir} holds no valid version") from err

    def _announced(self) -> bool:
        """True when ``newest`` names a version published after the one this handler wants (it wants it now)."""
        announced = self._newest() if self._newest is not None else None
        if announced is not None and announced.order > self._want.order:
            self._want = announced
            return True
        return False

    def load_model(self) -> ServedModel:
        if self._threads:
            import torch

            torch.set_num_threads(self._threads)
        self._announced()
        return self._serve()

    def _serve(self) -> ServedModel:
        """The newest publication this process has loaded, loading what the handler wants when it is newer."""
        with _SERVED_LOCK:
            loaded = _SERVED.setdefault(self._token, {})
            newest = _NEWEST.get(self._token)
            if newest is not None and self._want.order <= newest.version.order:
                return newest  # never back to an earlier publication (an older one named by update_model_path)
            served = loaded.get(self._want.path)
            if served is None and newest is not None and self._want.path in _FAILED.get(self._token, {}):
                return newest  # tried once: a copy that did not load never will (its name is its digest)
            if served is None:
                try:
                    served = self._load(self._want)
                except Exception as err:  # noqa: BLE001 - a bad or missing version must not stop serving
                    failed = _FAILED.setdefault(self._token, {})
                    failed[self._want.path] = f"{type(err).__name__}: {err}"
                    if len(failed) > 100:  # bounded: the oldest reasons go
                        failed.pop(next(iter(failed)))
                    if newest is not None:
                        _log.warning("model at %s rejected (%s: %s); still serving version %d", self._want.path,
                                     type(err).__name__, err, newest.version.version)
                        return newest
                    served = self._fallback(err)
                _log.info("loaded model version %d of run %s from %s", served.version.version,
                          served.version.run_id or "(unnamed)", served.version.path)
            if newest is not None and newest.version.order >= served.version.order:
                return newest
            _NEWEST[self._token] = served
            loaded.clear()  # earlier publications are never served again
            loaded[served.version.path] = served
            return served

    def run_inference(self, batch: Sequence[Any], model: ServedModel,
                      inference_args: dict | None = None) -> Iterable[PredictionResult]:
        if self._announced() or self._want.order > model.version.order:
            model = self._serve()  # a version published since Beam loaded ``model`` (or another copy's newer one)
            if self._want.order > model.version.order:
                self._not_serving(model)
        parts = [b.features for b in batch if b.features is not None and b.features.num_rows]
        sizes = [0 if b.features is None else b.features.num_rows for b in batch]
        table = pa.Table.from_batches(parts) if parts else pa.table({})
        outputs = forward(model.module, table, self._spec, n_classes=self._n_classes,
                          target_scale=(self._shift, self._scale), device=self._device,
                          what=f"model version {model.version.version}")  # pipelines.serving.forward
        scored_ms = int(time.time() * 1000)
        tag = model_tag(model.version)
        bounds = np.cumsum([0] + sizes)
        for b, lo, hi in zip(batch, bounds[:-1], bounds[1:]):
            yield PredictionResult(b, (outputs[lo:hi], scored_ms), tag)

    def _not_serving(self, model: ServedModel) -> None:
        """The wanted version does not serve: a warning with the reason once it was announced ``warn_after_s`` ago."""
        at = getattr(self._newest, "announced_at", None)
        since = time.time() - at() if at is not None else 0.0
        warned = _WARNED.setdefault(self._token, set())
        if since < self._warn_after_s or self._want.path in warned:
            return
        warned.add(self._want.path)
        reason = _FAILED.get(self._token, {}).get(self._want.path, "not loaded yet")
        _log.warning("model version %d of run %s was announced %.0f s ago but micro-batches are still scored with "
                     "version %d: %s", self._want.version, self._want.run_id or "(unnamed)", since,
                     model.version.version, reason)

    def get_num_bytes(self, batch: Sequence[Any]) -> int:
        return sum(b.features.nbytes for b in batch if b.features is not None)

    def get_metrics_namespace(self) -> str:
        return "flowtrain_scoring"

