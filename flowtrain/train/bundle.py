"""A model bundle: everything needed to predict, without the dataset directory or the run's other files.

::

    bundle/
      weights.safetensors  the model's tensors (safetensors: no code runs on load)
      model.json           the architecture: {"kind": "mlp", "hidden", "dropout"} or {"kind": "factory",
                           "factory": "module:function"}, the ModelSpec (inputs, outputs, task, classes) and
                           the regression target's scale
      features.json        the feature spec (label, task, numeric / categorical columns) and the training
                           statistics (means, standard deviations, vocabularies, class names)
      model.pt2            optional (``flowtrain export --torch-export``): a ``torch.export`` program of the model
                           for use without flowtrain: ``torch.export.load(path).module()(x_num, x_cat)`` with
                           x_num float32 [N, numerics] (standardized with features.json's means and standard
                           deviations) and x_cat int64 [N, categoricals] (index in the vocabulary + 1, 0 for
                           unseen); it returns logits ([N] or [N, K]) or the standardized regression value
      bundle.json          written last: format, flowtrain version, run, and the SHA-256 of each file above

``read_bundle(DIR)`` checks every checksum and the version first; a missing or modified file, or a bundle
from a newer flowtrain, is a ``BundleError`` naming the file. ``load_module(DIR)`` returns the model in eval
mode.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowtrain.errors import BundleError

FORMAT = 1
FILES = ("weights.safetensors", "model.json", "features.json")
EXPORTED = "model.pt2"
MANIFEST = "bundle.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in str(text).split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def write_bundle(out: str | Path, model, data, config, *, factory: str | None = None, run: str = "",
                 torch_export: bool = False) -> Path:
    """Write the bundle of ``model`` trained on ``data`` (a ``TabularDataset``) with ``config`` (a
    ``TrainConfig``) into ``out``: files first, ``bundle.json`` last, through a temporary directory
    renamed into place (a reader never sees half a bundle)."""
    from safetensors.torch import save_file

    from flowtrain import __version__
    from flowtrain.train.loader import target_scale
    from flowtrain.train.model import model_spec

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "weights.safetensors"))
        arch = ({"kind": "factory", "factory": factory} if factory else
                {"kind": "mlp", "hidden": list(config.hidden), "dropout": config.dropout})
        _write_json(tmp / "model.json", {"architecture": arch, "spec": model_spec(data).to_dict(),
                                         "target_scale": list(target_scale(data))})
        _write_json(tmp / "features.json", {"spec": data.spec.to_dict(), "stats": data.stats,
                                            "classes": data.classes, "kind": data.kind})
        names = list(FILES)
        if torch_export:
            _write_program(tmp / EXPORTED, model, data)
            names.append(EXPORTED)
        checks = {name: _sha256(tmp / name) for name in names}
        _write_json(tmp / MANIFEST, {"format": FORMAT, "flowtrain_version": __version__, "run": run,
                                     "files": checks})
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            import shutil

            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_program(path: Path, model, data) -> None:
    """A ``torch.export`` program of ``model`` with a dynamic batch dimension."""
    import torch

    from flowtrain.errors import FlowtrainError

    model = model.eval()
    example = (torch.zeros(2, data.n_numeric), torch.zeros(2, len(data.cardinalities), dtype=torch.long))
    batch = torch.export.Dim("batch", min=1)
    try:
        program = torch.export.export(model, example, dynamic_shapes=({0: batch}, {0: batch}))
    except Exception as err:  # noqa: BLE001 - a user's model torch.export cannot trace: say so, name the option
        raise FlowtrainError(f"--torch-export: torch.export cannot export this model ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}); leave out --torch-export") from None
    torch.export.save(program, str(path))


def bundle_dir(path: str | Path, option: str = "--model") -> Path:
    """A bundle directory, or a run directory holding ``bundle/``; else an error naming ``path``."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if (path / "bundle" / MANIFEST).is_file():
        return path / "bundle"
    if not path.exists():
        raise BundleError(f"{option} {path}: no such directory; give a `flowtrain batch` run directory or a bundle "
                          f"(`flowtrain export RUN --out DIR`)")
    if (path / "model.pt").is_file():
        raise BundleError(f"{option} {path}: this run has no bundle/ (written by an older flowtrain); make one "
                          f"with `flowtrain export {path} --out {path}/bundle`")
    raise BundleError(f"{option} {path}: neither a bundle ({MANIFEST}) nor a run directory with bundle/{MANIFEST}")


@dataclass
class Bundle:
    """A checked bundle's contents."""

    path: Path
    manifest: dict
    model: dict  # model.json
    features: dict  # features.json

    @property
    def version(self) -> str:
        """The model's identity: the run and the first 12 hex digits of its weights' SHA-256."""
        sha = self.manifest["files"]["weights.safetensors"][:12]
        return f"{self.manifest.get('run') or self.path.name}@{sha}"


def read_bundle(path: str | Path, option: str = "--model") -> Bundle:
    """Read and check a bundle (checksums, version); a ``BundleError`` naming the file otherwise."""
    from flowtrain import __version__

    path = bundle_dir(path, option)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise BundleError(f"{path / MANIFEST}: cannot be read ({err}); export the bundle again") from None
    made_by = str(manifest.get("flowtrain_version", "0"))
    if _version_tuple(made_by) > _version_tuple(__version__) or int(manifest.get("format", 0)) > FORMAT:
        raise BundleError(f"{path / MANIFEST}: written by flowtrain {made_by} (bundle format "
                          f"{manifest.get('format')}), newer than this flowtrain {__version__}: upgrade flowtrain")
    files = manifest.get("files") or {}
    for name in dict.fromkeys([*FILES, *files]):
        if Path(name).name != name or name in (".", "..", MANIFEST):
            raise BundleError(f"{path / MANIFEST}: {name!r} is not a file of the bundle; export the bundle again")
        f = path / name
        if not f.is_file():
            raise BundleError(f"{f}: missing from the bundle; export the bundle again")
        if name not in files:
            raise BundleError(f"{path / MANIFEST}: no checksum for {name}; export the bundle again")
        if _sha256(f) != files[name]:
            raise BundleError(f"{f}: modified since the bundle was written (SHA-256 differs from {MANIFEST}); "
                              f"export the bundle again")
    model = json.loads((path / "model.json").read_text())
    features = json.loads((path / "features.json").read_text())
    return Bundle(path, manifest, model, features)


def build_module(bundle: Bundle):
    """The bundle's model with its weights, in eval mode on the CPU."""
    from safetensors.torch import load_file

    from flowtrain.train.model import ModelSpec, from_factory, tabular_mlp

    spec = ModelSpec.from_dict(bundle.model["spec"])
    arch = bundle.model["architecture"]
    if arch["kind"] == "factory":
        module = from_factory(arch["factory"], spec)
    elif arch["kind"] == "mlp":
        module = tabular_mlp(spec, arch["hidden"], arch["dropout"])
    else:
        raise BundleError(f"{bundle.path / 'model.json'}: unknown model kind {arch['kind']!r}")
    state = load_file(str(bundle.path / "weights.safetensors"))
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise BundleError(f"{bundle.path / 'weights.safetensors'}: does not fit the architecture of model.json "
                          f"({str(err).splitlines()[0]})") from None
    return module.eval()


def load_module(path: str | Path) -> tuple[Any, int]:
    """``path`` -> (the model in eval mode, 0): the model loader of the model handler ``flowtrain predict``
    runs on every worker (a bundle is one fixed model: version 0 of its run)."""
    return build_module(read_bundle(path)), 0
