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
      bundle.json          written last: format, flowtrain version, run, the SHA-256 (``files``) and the size
                           (``bytes``) of each file above, ``sha256`` (the weights'), and with a bundle key
                           ``signature``: HMAC-SHA256 over the rest, the scheme of model updates
                           (``connectors.model_updates.sign_record``)

The directory is 0755 and its files 0644 (less what the user's umask takes away).

``read_bundle(DIR)`` checks ``bundle.json`` (its fields' types, the signature when a key is set, the
version), then every file's size, then every checksum; a missing, resized or modified file, a malformed
``bundle.json`` or a bundle from a newer flowtrain is a one-line ``BundleError`` naming the file.
``build_module`` builds the model: a built-in architecture by name (``ARCHITECTURES``; its shapes checked
against the weights' own before any allocation), a ``factory`` (a user's code) only with ``trust_code``.
Loading a bundle imports no code otherwise.
"""
from __future__ import annotations

import hmac
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.atomic import file_sha256
from connectors.model_updates import MIN_KEY_BYTES, sign_record
from connectors.secrets import read_secret_file
from flowtrain.errors import BundleError, FlowtrainError
from flowtrain.train.bundle_tables import check_id_tables, check_table_options
from flowtrain.version import __version__

FORMAT = 1
FILES = ("weights.safetensors", "model.json", "features.json")
EXPORTED = "model.pt2"
MANIFEST = "bundle.json"
#: The environment variable holding the bundle key when no ``--bundle-key-file`` is given.
BUNDLE_KEY_ENV = "FLOWTRAIN_BUNDLE_KEY"
#: Bounds checked before anything is read whole: bundle.json, model.json / features.json, a file of a bundle
#: whose bundle.json records no sizes (written by an older flowtrain), a layer's or a table's size.
MAX_MANIFEST_BYTES = 1 << 20
MAX_JSON_BYTES = 256 << 20
MAX_FILE_BYTES = 4 << 30
MAX_DIMENSION = 1 << 24
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in str(text).split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_bundle(out: str | Path, model, data, config, *, factory: str | None = None, run: str = "",
                 torch_export: bool = False, key: bytes | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write the bundle of ``model`` trained on ``data`` (a ``TabularDataset``) with ``config`` (a
    ``TrainConfig``) into ``out``: files first, ``bundle.json`` last (signed with ``key`` when given),
    through a temporary directory renamed into place (a reader never sees half a bundle). An existing
    ``out`` is replaced only when it is empty or a bundle flowtrain wrote (``owned_bundle_files``; a link,
    a file or anything else there is a ``BundleError`` before anything is written). ``extra``: more JSON
    files, ``{name: content}`` (``drift_reference.json``), listed and checksummed like the others."""
    from safetensors.torch import save_file

    from flowtrain.train.loader import target_scale
    from flowtrain.train.models import model_spec

    out = Path(out)
    owned_bundle_files(out)  # what is there now must be ours to replace: checked before any work
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "weights.safetensors"))
        arch = ({"kind": "factory", "factory": factory} if factory else
                model.architecture(config.hidden, config.dropout) if hasattr(model, "architecture") else
                {"kind": "mlp", "hidden": list(config.hidden), "dropout": config.dropout})
        _write_json(tmp / "model.json", {"architecture": arch, "spec": model_spec(data).to_dict(),
                                         "target_scale": list(target_scale(data))})
        _write_json(tmp / "features.json", {"spec": data.spec.to_dict(), "stats": data.stats,
                                            "classes": data.classes, "kind": data.kind})
        names = list(FILES)
        for name, content in (extra or {}).items():  # more JSON files (the drift reference), checksummed alike
            _write_json(tmp / name, content)
            names.append(name)
        if torch_export:
            _write_program(tmp / EXPORTED, model, data)
            names.append(EXPORTED)
        checks = {name: file_sha256(tmp / name) for name in names}
        manifest = {"format": FORMAT, "flowtrain_version": __version__, "run": run, "files": checks,
                    "bytes": {name: (tmp / name).stat().st_size for name in names},
                    "sha256": checks["weights.safetensors"]}
        if key is not None:
            manifest = sign_record(manifest, key)
        _write_json(tmp / MANIFEST, manifest)
        mask = _umask()  # mkdtemp's 0700 (and whatever a writer chose): a bundle is to be shared, like a file
        for name in [*names, MANIFEST]:
            (tmp / name).chmod(0o666 & ~mask)
        tmp.chmod(0o777 & ~mask)
        if out.exists() or out.is_symlink():
            owned_bundle_files(out)  # again, just before the swap
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            remove_bundle(old)  # only the files the old bundle.json lists
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_program(path: Path, model, data) -> None:
    """A ``torch.export`` program of ``model`` with a dynamic batch dimension."""
    import torch

    model = model.eval()
    example = (torch.zeros(2, data.n_numeric), torch.zeros(2, len(data.cardinalities), dtype=torch.long))
    batch = torch.export.Dim("batch", min=1)
    try:
        program = torch.export.export(model, example, dynamic_shapes=({0: batch}, {0: batch}))
    except Exception as err:  # noqa: BLE001 - a user's model torch.export cannot trace: say so, name the option
        raise FlowtrainError(f"--torch-export: torch.export cannot export this model ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}); leave out --torch-export") from None
    torch.export.save(program, str(path))


def owned_bundle_files(path: str | Path, option: str = "--out") -> list[str]:
    """The files of the bundle directory ``path`` that flowtrain wrote (``bundle.json`` last), ``[]`` when
    nothing is there; a ``BundleError`` naming what is not a bundle flowtrain wrote: ``path`` a symbolic
    link or a file, no ``bundle.json``, or any entry ``bundle.json`` does not list (a user's file, a
    sub-directory, a link). Nothing is followed or read beyond ``bundle.json``."""
    path = Path(path)
    if path.is_symlink():
        raise BundleError(f"{option} {path} is a symbolic link (to {os.readlink(path)}); flowtrain never follows a "
                          f"link when it replaces or deletes a bundle: remove the link or choose another path")
    if not path.exists():
        return []
    if not path.is_dir():
        raise BundleError(f"{option} {path} is a file, not a bundle directory; flowtrain will not replace it: "
                          f"choose another path")
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return []
    if MANIFEST not in entries or (path / MANIFEST).is_symlink():
        raise BundleError(f"{option} {path} is not a bundle flowtrain wrote (no {MANIFEST}; it holds "
                          f"{_some(entries)}); flowtrain replaces or deletes only its own bundles: move those files "
                          f"or choose another path")
    manifest = _manifest(path)
    listed = set(manifest["files"]) | {MANIFEST}
    foreign = [e for e in entries if e not in listed or (path / e).is_symlink() or not (path / e).is_file()]
    if foreign:
        raise BundleError(f"{option} {path} holds files its {MANIFEST} does not list ({_some(foreign)}): they are "
                          f"not flowtrain's, so flowtrain will not delete or replace this bundle; move them or "
                          f"choose another path")
    return [*(e for e in entries if e != MANIFEST), MANIFEST]


def remove_bundle(path: str | Path, option: str = "--out") -> list[str]:
    """Delete the bundle at ``path`` if flowtrain wrote it (``owned_bundle_files``; else a ``BundleError`` and
    nothing is deleted): ``bundle.json`` first, then its files, then the directory. Returns what was deleted."""
    path = Path(path)
    files = owned_bundle_files(path, option)
    for name in [MANIFEST, *files[:-1]] if files else []:
        (path / name).unlink(missing_ok=True)
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    return files


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


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

    def extra_json(self, name: str) -> dict | None:
        """A JSON file ``write_bundle(extra=...)`` added (``read_bundle`` checked its checksum with the others);
        None when the bundle has none (written before it existed)."""
        if name not in (self.manifest.get("files") or {}):
            return None
        return _json_object(self.path / name)

    @property
    def version(self) -> str:
        """The model's identity: the run and the first 12 hex digits of its weights' SHA-256."""
        sha = self.manifest["files"]["weights.safetensors"][:12]
        return f"{self.manifest.get('run') or self.path.name}@{sha}"

    @property
    def signed(self) -> bool:
        return "signature" in self.manifest


def _manifest(path: Path) -> dict:
    """``bundle.json`` of bundle directory ``path``, its fields type-checked; a one-line ``BundleError`` otherwise."""
    where = path / MANIFEST
    try:
        if where.stat().st_size > MAX_MANIFEST_BYTES:
            raise BundleError(f"{where}: {where.stat().st_size:,} bytes, not a bundle manifest (at most "
                              f"{MAX_MANIFEST_BYTES:,}); export the bundle again")
        manifest = json.loads(where.read_text())
    except (OSError, ValueError) as err:
        raise BundleError(f"{where}: cannot be read ({str(err).splitlines()[0]}); export the bundle again") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: not a JSON object; export the bundle again")
    fmt, files, sizes = manifest.get("format"), manifest.get("files"), manifest.get("bytes")
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        raise BundleError(f"{where}: 'format' is {fmt!r}, not a bundle format number; export the bundle again")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) and _HEX64.fullmatch(v)
                                              for k, v in files.items()):
        raise BundleError(f"{where}: 'files' must map file names to SHA-256 hex digests; export the bundle again")
    if sizes is not None and (not isinstance(sizes, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in sizes.items())):
        raise BundleError(f"{where}: 'bytes' must map file names to sizes in bytes; export the bundle again")
    for key in ("run", "flowtrain_version", "signature", "sha256"):
        if key in manifest and not isinstance(manifest[key], str):
            raise BundleError(f"{where}: '{key}' must be a string; export the bundle again")
    for name in files:
        if Path(name).name != name or name in (".", "..", MANIFEST):
            raise BundleError(f"{where}: {name!r} is not a file of the bundle; export the bundle again")
    return manifest


def _check_signature(path: Path, manifest: dict, key: bytes) -> None:
    """The manifest's HMAC (``connectors.model_updates.sign_record``'s scheme) under ``key``, else a ``BundleError``."""
    signature = manifest.get("signature")
    if signature is None:
        raise BundleError(f"{path / MANIFEST}: the bundle is not signed, and a bundle key is set (--bundle-key-file "
                          f"or ${BUNDLE_KEY_ENV}); export it again with that key, or leave the key out")
    try:
        want = sign_record(manifest, key)["signature"]
    except ValueError as err:  # no digest to sign
        raise BundleError(f"{path / MANIFEST}: cannot be verified ({err}); export the bundle again") from None
    if not hmac.compare_digest(want, signature):
        raise BundleError(f"{path / MANIFEST}: bad signature: not signed with this bundle key (modified since it was "
                          f"written, or signed with another key)")


def read_bundle(path: str | Path, option: str = "--model", *, key: bytes | None = None) -> Bundle:
    """Read and check a bundle: ``bundle.json``'s fields, its signature (with ``key``: a bundle that is not
    signed with it is refused), the version, each file's size (before any hashing), then each checksum; a
    one-line ``BundleError`` naming the file otherwise."""
    path = bundle_dir(path, option)
    manifest = _manifest(path)
    if key is not None:
        _check_signature(path, manifest, key)
    made_by = str(manifest.get("flowtrain_version", "0"))
    if _version_tuple(made_by) > _version_tuple(__version__) or manifest["format"] > FORMAT:
        raise BundleError(f"{path / MANIFEST}: written by flowtrain {made_by} (bundle format "
                          f"{manifest.get('format')}), newer than this flowtrain {__version__}: upgrade flowtrain")
    files, sizes = manifest["files"], manifest.get("bytes") or {}
    names = list(dict.fromkeys([*FILES, *files]))
    for name in names:  # every size first: nothing is hashed before all are known to be what bundle.json says
        f = path / name
        if f.is_symlink() or not f.is_file():
            raise BundleError(f"{f}: missing from the bundle (or not a regular file); export the bundle again")
        if name not in files:
            raise BundleError(f"{path / MANIFEST}: no checksum for {name}; export the bundle again")
        size, bound = f.stat().st_size, sizes.get(name)
        if bound is not None and size != bound:
            raise BundleError(f"{f}: {size:,} bytes, {MANIFEST} says {bound:,}: modified since the bundle was "
                              f"written; export the bundle again")
        if bound is None and size > MAX_FILE_BYTES:
            raise BundleError(f"{f}: {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte bound of a bundle file "
                              f"without a size in {MANIFEST}; export the bundle again")
        limit = MAX_JSON_BYTES if name.endswith(".json") else None
        if limit is not None and size > limit:
            raise BundleError(f"{f}: {size:,} bytes, over the {limit:,}-byte bound of a bundle's JSON file")
    for name in names:
        f = path / name
        if file_sha256(f) != files[name]:
            raise BundleError(f"{f}: modified since the bundle was written (SHA-256 differs from {MANIFEST}); "
                              f"export the bundle again")
    model, features = (_json_object(path / n) for n in ("model.json", "features.json"))
    return Bundle(path, manifest, model, features)


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise BundleError(f"{path}: cannot be read ({str(err).splitlines()[0]}); export the bundle again") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path}: not a JSON object; export the bundle again")
    return data


def _positive_ints(value, most: int) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= most
                                           for v in value)


def _spec_of(bundle: Bundle):
    """model.json's ``ModelSpec``, its sizes type-checked and bounded."""
    from flowtrain.train.models import ModelSpec

    where = bundle.path / "model.json"
    spec = bundle.model.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("numeric"), list) \
            or not isinstance(spec.get("categorical"), list) \
            or not _positive_ints(spec.get("cardinalities"), MAX_DIMENSION) \
            or not _positive_ints([spec.get("outputs")], MAX_DIMENSION) \
            or len(spec["cardinalities"]) != len(spec["categorical"]):
        raise BundleError(f"{where}: 'spec' is not a model spec (numeric and categorical columns, a cardinality per "
                          f"categorical, outputs: positive whole numbers of at most {MAX_DIMENSION:,}); export the "
                          f"bundle again")
    try:
        return ModelSpec.from_dict(spec)
    except (KeyError, TypeError, ValueError) as err:
        raise BundleError(f"{where}: 'spec' is not a model spec ({err}); export the bundle again") from None


def _mlp(bundle: Bundle, spec, arch: dict):
    """The built-in wide-and-deep MLP of ``arch`` (hidden sizes and dropout checked; built on the meta device)."""
    from flowtrain.train.models import tabular_mlp

    hidden, dropout = arch.get("hidden"), arch.get("dropout", 0.0)
    ensemble, embedding = arch.get("ensemble", 1), arch.get("numeric_embedding", 0)
    if not _positive_ints(hidden, MAX_DIMENSION) or len(hidden) > 64 or isinstance(dropout, bool) \
            or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise BundleError(f"{bundle.path / 'model.json'}: the mlp's 'hidden' must be at most 64 positive whole "
                          f"numbers of at most {MAX_DIMENSION:,} and 'dropout' a fraction; export the bundle again")
    if not _positive_ints([ensemble], 1024) or not (embedding == 0 or _positive_ints([embedding], 4096)):
        raise BundleError(f"{bundle.path / 'model.json'}: the mlp's 'ensemble' must be a whole number from 1 to 1,024 "
                          f"and 'numeric_embedding' one from 0 to 4,096; export the bundle again")
    return tabular_mlp(spec, hidden, float(dropout), ensemble=int(ensemble), numeric_embedding=int(embedding))


def _mlp_ids(bundle: Bundle, spec, arch: dict):
    """Wide and deep with ID tables (``flowtrain.train.models.ids``); the tables come with the weights."""
    from flowtrain.train.models.ids import from_architecture

    _mlp(bundle, spec, arch)  # hidden and dropout checked alike
    cols, dim = arch.get("id_columns"), arch.get("id_dim")
    if not isinstance(cols, list) or not cols or not all(isinstance(c, str) for c in cols) \
            or not _positive_ints([dim], MAX_DIMENSION) or not isinstance(arch.get("table", {}), dict):
        raise BundleError(f"{bundle.path / 'model.json'}: the mlp_ids model needs 'id_columns' (names), 'id_dim' "
                          f"and 'table' options; export the bundle again")
    check_table_options(bundle.path / "model.json", arch.get("table", {}), dim)  # before a table is made
    return from_architecture(spec, arch)


#: The architectures a bundle may name: built into flowtrain, nothing imported. ``factory`` is a user's
#: code (``--model MODULE:FACTORY``) and needs ``trust_code``.
ARCHITECTURES = {"mlp": _mlp, "mlp_ids": _mlp_ids}


def _weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes from the safetensors header (nothing loaded)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except Exception as err:  # noqa: BLE001 - any unreadable header: named
        raise BundleError(f"{path}: not a safetensors file ({str(err).splitlines()[0] if str(err) else err}); "
                          f"export the bundle again") from None


def check_code(bundle: Bundle, trust_code: bool) -> None:
    """A ``BundleError`` when the bundle's model is code (a ``factory``) and the caller did not say to trust it."""
    arch = bundle.model.get("architecture")
    if isinstance(arch, dict) and arch.get("kind") == "factory" and not trust_code:
        raise BundleError(f"{bundle.path / 'model.json'}: the model is code (factory {arch.get('factory')!r}): "
                          f"loading it imports and runs that module; load only a bundle you trust, with "
                          f"trust_code=True (flowtrain.load) or --trust-code (flowtrain predict)")


def build_module(bundle: Bundle, *, trust_code: bool = False):
    """The bundle's model with its weights, in eval mode on the CPU.

    A built-in architecture (``ARCHITECTURES``) is built on the meta device first (no memory) and its
    parameter shapes compared with the weights' own (bounded by the file's size) before anything is
    allocated. A ``factory`` architecture imports and runs the module model.json names: only with
    ``trust_code=True`` (``--trust-code``), else a ``BundleError`` saying so."""
    from safetensors.torch import load_file

    from flowtrain.train.models import from_factory, skeleton

    where = bundle.path / "model.json"
    spec = _spec_of(bundle)
    arch = bundle.model.get("architecture")
    kind = arch.get("kind") if isinstance(arch, dict) else None
    shapes = _weight_shapes(bundle.path / "weights.safetensors")
    # every ID table's state against its own tensors and model.json, before anything is allocated
    check_id_tables(bundle.path / "weights.safetensors", shapes, arch.get("id_dim") if kind == "mlp_ids" else None)
    if kind == "factory":
        check_code(bundle, trust_code)
        module = from_factory(str(arch.get("factory")), spec)
    elif kind in ARCHITECTURES:
        meta = skeleton(lambda: ARCHITECTURES[kind](bundle, spec, arch))
        want = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
        # an ID table's size is its own (flowtrain.train.ids): only its presence is the architecture's
        want = {k: (() if ".table." in k else v) for k, v in want.items()}
        shapes = {k: (() if ".table." in k else v) for k, v in shapes.items()}
        if want != shapes:
            diff = sorted(set(want) ^ set(shapes)) or sorted(k for k in want if want[k] != shapes[k])
            name = diff[0]
            raise BundleError(f"{bundle.path / 'weights.safetensors'}: does not fit the architecture of model.json "
                              f"({name}: {list(shapes.get(name, ())) if name in shapes else 'missing'} in the "
                              f"weights, {list(want[name]) if name in want else 'not a parameter'} in model.json); "
                              f"export the bundle again")
        module = ARCHITECTURES[kind](bundle, spec, arch)
    else:
        raise BundleError(f"{where}: unknown model kind {kind!r} (built in: {', '.join(ARCHITECTURES)}, or factory)")
    state = load_file(str(bundle.path / "weights.safetensors"))
    try:
        module.load_state_dict(state)
    except (RuntimeError, ValueError, IndexError, KeyError) as err:
        raise BundleError(f"{bundle.path / 'weights.safetensors'}: does not fit the architecture of model.json "
                          f"({str(err).splitlines()[0]})") from None
    return module.eval()


def bundle_key(key_file: str | None, option: str = "--bundle-key-file") -> bytes | None:
    """The bundle key: ``key_file``'s content (a secret file: only its owner may read it), else
    ``$FLOWTRAIN_BUNDLE_KEY``, else None (bundles are not signed or verified)."""
    if key_file:
        try:
            key = read_secret_file(key_file, option).rstrip(b"\r\n")
        except ValueError as err:
            raise BundleError(str(err)) from None
        where = f"{option} {key_file}"
    elif os.environ.get(BUNDLE_KEY_ENV):
        key, where = os.environ[BUNDLE_KEY_ENV].encode(), f"${BUNDLE_KEY_ENV}"
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise BundleError(f"{where}: the bundle key has {len(key)} bytes; use at least {MIN_KEY_BYTES} (e.g. "
                          f"`(umask 077; head -c 32 /dev/urandom | base64 > bundle.key)`)")
    return key


def load_module(path: str | Path, *, trust_code: bool = False, key_file: str | None = None) -> tuple[Any, int]:
    """``path`` -> (the model in eval mode, 0): the model loader of the model handler ``flowtrain predict``
    runs on every worker (a bundle is one fixed model: version 0 of its run). The worker checks the bundle
    itself (with the key from ``key_file`` or the environment when one is set)."""
    return build_module(read_bundle(path, key=bundle_key(key_file)), trust_code=trust_code), 0
