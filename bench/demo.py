"""The dataset a benchmark runs on without ``--input``: the default dataset preset (``pipelines.presets``, the
demo), reached through its hooks as the commands reach it, never by name. A hook the preset lacks is a
one-line error naming the bench, the preset and the hook."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from connectors.dataset_spec import FeatureSpec
from flowtrain.local.paths import cache_root
from pipelines.presets import DatasetPreset, default_preset


def demo() -> DatasetPreset:
    """The default dataset preset (the demo's, unless a user registered another with ``default=True``)."""
    return default_preset()


def describe(preset: DatasetPreset | None = None) -> str:
    """How a bench's report names the demo: ``the demo dataset (TITLE)``."""
    preset = preset or demo()
    return f"the demo dataset ({preset.title or preset.name})"


def hook(preset: DatasetPreset, name: str, bench: str) -> Callable | str:
    """The preset's hook ``name``, or a one-line SystemExit when the preset has none."""
    found = getattr(preset, name)
    if not found:
        raise SystemExit(f"bench{' ' + bench if bench else ''}: the default dataset preset {preset.name!r} has no `{name}` hook "
                         f"(pipelines.presets.DatasetPreset.{name}); register a default preset that has one")
    return found


def demo_inputs(preset: DatasetPreset) -> dict[str, str]:
    """The preset's input files under flowtrain's cache (written there the first time)."""
    return preset.demo_inputs(cache_root())


def scaled_inputs(preset: DatasetPreset, factor: int, bench: str) -> tuple[dict[str, str], FeatureSpec]:
    """The preset's inputs at ``factor`` times their rows (its ``scale`` hook, cached under
    ``$FLOWTRAIN_CACHE/<cache_name>/scaled``) and the spec for them; 1x needs no hook."""
    inputs = demo_inputs(preset)
    if factor == 1 and preset.scale is None:
        return inputs, preset.spec
    scale = hook(preset, "scale", bench)
    return scale(inputs, factor, cache_root() / (preset.cache_name or preset.name) / "scaled")


def event_rows(preset: DatasetPreset, inputs: dict[str, str], bench: str) -> int:
    """The rows of the preset's events input (its ``events_input``): the rows an ETL reads."""
    import pyarrow.parquet as pq

    return pq.read_metadata(inputs[hook(preset, "events_input", bench)]).num_rows


def build_demo(preset: DatasetPreset, bench: str, *, dataset_path: str | Path, options,
               spec: FeatureSpec | None = None, inputs: dict[str, str] | None = None) -> dict:
    """The preset's dataset (its ``build`` over ``inputs``, default its demo inputs) into ``dataset_path``, the
    manifest recording the preset (``DatasetPreset.build_dataset``); returns the manifest."""
    hook(preset, "build", bench)
    return preset.build_dataset(inputs if inputs is not None else demo_inputs(preset), dataset_path=str(dataset_path),
                                dead_letters_path=None, options=options, spec=spec)
