"""Dataset presets: a named dataset that flowtrain can build, stream and replay without a user's files.

A preset holds what the commands would otherwise have to know about one domain: the dataset's name (a stream's
default topics are ``NAME-raw``, ``NAME-features``, ...), its feature spec, its demo inputs (written once under
a cache directory), how its dataset is built from them (a Beam batch ETL), its stream enrichment (a domain's
reference-data step between parsing and the features) and the events ``flowtrain replay`` produces for it. The
commands, the stream engine and the scorer ask this registry (``preset_for(manifest)``, ``default_preset()``)
and never name a domain. The demo is one preset, registered in its own package's ``preset`` module like a
user's::

    from pipelines.presets import DatasetPreset, register_preset

    register_preset(DatasetPreset(name="sensors", spec=SENSORS_SPEC, matches=lambda m: m.get("name") == "sensors",
                                  enrichment=lambda inputs: SensorSites(inputs["sites"])))

Presets are found, the first time the registry is asked, in: the ``preset`` module of each package under
``pipelines`` (the built-in ones), the ``flowtrain.presets`` entry-point group (an installed package's:
``[project.entry-points."flowtrain.presets"] sensors = "mypkg.preset"``), the modules named in
``$FLOWTRAIN_PRESETS`` (comma-separated ``MODULE`` or ``MODULE:NAME``), and any ``register_preset`` call
in code that ran before.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pkgutil
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pipelines
from connectors.atomic import atomic_write
from connectors.dataset_spec import FeatureSpec
from connectors.paths import is_local_path

__all__ = ["DatasetPreset", "ReplayEvents", "register_preset", "unregister_preset", "presets", "get_preset",
           "load_preset", "preset_for", "default_preset", "preset_name", "PresetNameError", "ENTRY_POINT_GROUP",
           "PRESETS_ENV"]

#: The entry-point group an installed package registers its presets in.
ENTRY_POINT_GROUP = "flowtrain.presets"
#: Comma-separated modules (``MODULE`` or ``MODULE:NAME``) imported for their presets.
PRESETS_ENV = "FLOWTRAIN_PRESETS"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class ReplayEvents:
    """What ``flowtrain replay`` produces for a preset: ``rows`` yields (event dict, Kafka key or None) in
    event-time order, ``schema`` (a ``pipelines.stream.events.EventSchema``) types them for Avro/Protobuf,
    ``malform(event, kind, rng)`` makes one bad event of each of ``malformed_kinds`` (for ``--malformed``)."""

    rows: Iterable[tuple[dict, bytes | None]]
    schema: Any
    malformed_kinds: Sequence[str]
    malform: Callable[..., bytes]


@dataclass(frozen=True)
class DatasetPreset:
    """A named dataset and what the commands need of it (every callable may be None where a preset lacks it).

    ``name``: the dataset's name and the prefix of its stream's topics. ``spec``: its ``FeatureSpec``.
    ``title``: what a run's report calls it; ``describe``: the batch ETL's one-line description.
    ``inputs(cache_dir) -> {name: path}``: the demo input files, written under ``cache_dir`` once.
    ``build(inputs, *, dataset_path, dead_letters_path, options, spec) -> manifest``: the batch ETL.
    ``enrichment(inputs) -> factory``: a picklable zero-argument factory of the stream's ``Enrichment``.
    ``replay() -> ReplayEvents``: the events ``flowtrain replay`` produces without ``--input``.
    ``matches(manifest) -> bool``: whether a dataset is this preset's (besides ``manifest["preset"] == name``).
    ``cache_name``: the folder under flowtrain's cache for its inputs (default: ``name``).

    For the benchmarks (``bench/``: a bench that needs a hook the default preset lacks says so in one line):
    ``events_input``: the input (a key of ``inputs``) whose rows are the dataset's rows, one per event; the
    others are reference data. ``scale(inputs, factor, cache_dir) -> (inputs, spec)``: the inputs at ``factor``
    times their rows, written under ``cache_dir`` once, and the spec for them (its split at the same place in
    the longer span); factor 1: both unchanged. ``joined(inputs, limit=None) -> pyarrow.Table``: the events
    with their reference data joined on (the raw columns a model reads), the first ``limit`` events when given.
    ``anchor(inputs, out_dir, spec) -> rows``: ``build`` as one plain pyarrow script (whole tables in memory, no
    Beam; each split's Parquet file under ``out_dir``), the rows of ``events_input`` read."""

    name: str
    spec: FeatureSpec
    title: str = ""
    describe: str = ""
    inputs: Callable[[Path], dict[str, str]] | None = None
    build: Callable[..., dict] | None = None
    enrichment: Callable[[dict[str, str]], Callable[[], Any]] | None = None
    replay: Callable[[], ReplayEvents] | None = None
    matches: Callable[[dict], bool] | None = None
    cache_name: str = ""
    events_input: str = ""
    scale: Callable[[dict[str, str], int, Path], tuple[dict[str, str], FeatureSpec]] | None = None
    joined: Callable[..., Any] | None = None
    anchor: Callable[[dict[str, str], Path, FeatureSpec], int] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"dataset preset name {self.name!r}: use letters, digits, '.', '_' or '-' (it starts "
                             f"the stream's Kafka topic names)")
        if not isinstance(self.spec, FeatureSpec):
            raise ValueError(f"dataset preset {self.name!r}: spec must be a FeatureSpec, not "
                             f"{type(self.spec).__name__}")

    def is_dataset(self, manifest: dict) -> bool:
        """Whether ``manifest`` (a dataset's) is this preset's."""
        if manifest.get("preset") == self.name:
            return True
        return bool(self.matches is not None and self.matches(manifest))

    def build_dataset(self, inputs: dict[str, str], *, dataset_path: str, dead_letters_path: str | None, options,
                      spec: FeatureSpec | None = None) -> dict:
        """Run the preset's batch ETL (``build``) into ``dataset_path``; returns the manifest, which records the
        preset that built it (``"preset": name``: ``preset_for`` finds it by name, not by guessing)."""
        if self.build is None:
            raise ValueError(f"dataset preset {self.name!r} has no batch ETL: give your files with --input")
        manifest = self.build(inputs, dataset_path=dataset_path, dead_letters_path=dead_letters_path,
                              options=options, spec=spec if spec is not None else self.spec)
        return _record_preset(dataset_path, self.name, manifest)

    def demo_inputs(self, cache_root: Path) -> dict[str, str]:
        """The preset's input files under ``cache_root / cache_name`` (written there the first time)."""
        if self.inputs is None:
            raise ValueError(f"dataset preset {self.name!r} has no demo inputs: give your files with --input")
        return self.inputs(Path(cache_root) / (self.cache_name or self.name))


def _record_preset(dataset_path: str, name: str, manifest: dict) -> dict:
    """The dataset's manifest with ``"preset": name`` (rewritten whole, atomically, when the build left it out)."""
    from connectors.dataset import MANIFEST, read_manifest

    written = read_manifest(dataset_path)
    if written.get("preset") != name:
        written["preset"] = name
        body = json.dumps(written, indent=2, default=str)
        if is_local_path(dataset_path):
            atomic_write(Path(dataset_path) / MANIFEST, body)
        else:  # an object store: one object, replaced whole
            from apache_beam.io.filesystems import FileSystems

            with FileSystems.create(FileSystems.join(dataset_path, MANIFEST)) as fh:
                fh.write(body.encode())
    return {**(manifest if isinstance(manifest, dict) else written), "preset": name}


_PRESETS: dict[str, DatasetPreset] = {}
_DEFAULT: list[str] = []  # the default preset's name, once one registered with default=True
_DISCOVERED: list[bool] = []


def register_preset(preset: DatasetPreset, *, default: bool = False) -> DatasetPreset:
    """Register ``preset`` under its name (a later registration of the name replaces it); ``default=True``
    makes it the dataset that ``flowtrain batch`` builds without ``--input`` and the stream reads by default."""
    if not isinstance(preset, DatasetPreset):
        raise ValueError(f"register_preset: a DatasetPreset, not {type(preset).__name__}")
    _PRESETS[preset.name] = preset
    if default:
        _DEFAULT[:] = [preset.name]
    return preset


def unregister_preset(name: str) -> None:
    """Remove a registered preset (tests, a user replacing a built-in)."""
    _PRESETS.pop(name, None)
    if _DEFAULT == [name]:
        _DEFAULT.clear()


def _load(spec: str, where: str) -> None:
    """Import ``MODULE`` (its import registers) or ``MODULE:NAME`` (a DatasetPreset there is registered)."""
    module_name, _, attr = spec.strip().partition(":")
    try:
        module = importlib.import_module(module_name)
        found = getattr(module, attr) if attr else None
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{where}: cannot load dataset preset {spec!r} ({type(err).__name__}: {err}); give "
                         f"MODULE or MODULE:NAME of an importable module") from None
    if found is not None:
        register_preset(found)


def _discover() -> None:
    if _DISCOVERED:
        return
    for info in sorted(pkgutil.iter_modules(pipelines.__path__), key=lambda i: i.name):
        if info.ispkg and importlib.util.find_spec(f"pipelines.{info.name}.preset") is not None:
            importlib.import_module(f"pipelines.{info.name}.preset")
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        _load(entry.value, f"entry point {entry.name!r} of {ENTRY_POINT_GROUP}")
    for spec in filter(None, os.environ.get(PRESETS_ENV, "").split(",")):
        _load(spec, f"${PRESETS_ENV}")
    _DISCOVERED.append(True)  # only once every source loaded: a broken one says so on every call


def presets() -> dict[str, DatasetPreset]:
    """Every registered preset by name."""
    _discover()
    return dict(_PRESETS)


def get_preset(name: str) -> DatasetPreset:
    """The preset named ``name``; unknown: a ValueError naming the registered ones."""
    found = presets().get(name)
    if found is None:
        raise ValueError(f"no dataset preset named {name!r} (registered: {', '.join(sorted(_PRESETS)) or 'none'}); "
                         f"register yours with pipelines.presets.register_preset or ${PRESETS_ENV}")
    return found


class PresetNameError(ValueError, argparse.ArgumentTypeError):
    """A ``--preset`` that names no preset (an ``ArgumentTypeError`` too: argparse shows its message)."""


def preset_name(value: Any) -> str:
    """``--preset``'s parser: ``value`` when it names a preset (``NAME`` registered, or ``MODULE:NAME``
    importable), else a ``PresetNameError`` (a ValueError) in one line naming it and the registered presets:
    checked with the other options, before a run directory is made or marked."""
    text = str(value).strip()
    try:
        if not text:
            raise ValueError("give NAME (a registered dataset preset) or MODULE:NAME")
        load_preset(text)
    except PresetNameError:
        raise
    except ValueError as err:
        raise PresetNameError(str(err)) from None
    return text


def load_preset(spec: str) -> DatasetPreset:
    """``NAME`` (a registered preset) or ``MODULE:NAME`` (a ``DatasetPreset`` in an importable module, registered
    now): the preset; either unknown: a ValueError in one line."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            found = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot load dataset preset {spec!r} ({type(err).__name__}: {err}); give NAME or "
                             f"MODULE:NAME of an importable module") from None
        if not isinstance(found, DatasetPreset):
            raise ValueError(f"{spec} is a {type(found).__name__}, not a pipelines.presets.DatasetPreset")
        presets()
        return register_preset(found)
    return get_preset(spec)


def preset_for(manifest: dict | None) -> DatasetPreset | None:
    """The preset whose dataset ``manifest`` is (``manifest["preset"]``, else the first whose ``matches`` says
    so, the last registered first), or None: a dataset of the user's own files."""
    if not isinstance(manifest, dict):
        return None
    for preset in reversed(presets().values()):
        if preset.is_dataset(manifest):
            return preset
    return None


def default_preset() -> DatasetPreset:
    """The default dataset's preset (the demo's, unless a user registered another with ``default=True``)."""
    _discover()
    if not _DEFAULT or _DEFAULT[0] not in _PRESETS:
        raise ValueError("no default dataset preset is registered: give your files with --input (or --dataset)")
    return _PRESETS[_DEFAULT[0]]
