"""The online trainer's engine config (``StreamTrainConfig``) and the model it starts from (``starting_model``).

A resumed run takes its architecture and weights from its own checkpoint. Without one the stream
trainer starts from ``init_weights``: a batch run's ``model.pt`` (its ``config.json`` gives the
architecture: model kind, hidden sizes, dropout, seed) or one of its checkpoints, trained on the
same dataset (``check_same_dataset``); without ``init_weights`` the architecture comes from the
options and the weights from its seed. Weights that are not finite are an error (``NonFiniteModel``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from connectors.dataset import read_manifest
from connectors.kafka import KafkaTarget, Topics
from flowtrain.train.loader import TabularDataset
from flowtrain.train.models import Architecture
from flowtrain.train.options import EngineSettings, StreamTrainOptions, UpdateOptions
from flowtrain.train.rundir.files import RunFiles
from flowtrain.train.stream.input import DEFAULT_MAX_SOURCE_GAP


@dataclass(kw_only=True)
class StreamTrainConfig(EngineSettings, UpdateOptions, StreamTrainOptions):
    """The online trainer's engine config: its options (``StreamTrainOptions``, ``UpdateOptions``, declared once in
    ``flowtrain.train.options``, where ``flowtrain stream train`` takes them from; ranges checked by
    ``connectors.fields.check`` when the trainer starts), what the trainer sets for its engine (``EngineSettings``:
    a resumed grid's stage cut) and what the command resolves from the others."""
    # the brokers, client settings and the replication factor of the topics it creates (the updates topic, the
    # dead letters), as the command resolved its options (connectors.kafka.target: not configuration)
    kafka: KafkaTarget
    # the topics (named after the dataset by the command: flowtrain.commands.stream.options.dataset_topics): run()
    # needs features, updates and dead_letters (feature messages the input check rejects, with their reason: the
    # pipeline's dead-letter topic); raw: the events the features come from, a row whose source offset is past its
    # end is a dead letter (None, or not on the brokers: a step of more than max_source_gap past the highest offset
    # trained is)
    topics: Topics
    run_dir: str  # the run directory (the command's --out)
    dataset_dir: str  # the batch dataset's directory (the command resolves --dataset): spec, statistics, vocabularies
    max_source_gap: int = DEFAULT_MAX_SOURCE_GAP  # not an option: a bound of the engine
    max_steps: int | None = None  # test hook: stop after this many steps

    def __post_init__(self) -> None:
        self.kafka, self.topics = KafkaTarget.of(self.kafka), Topics.of(self.topics)  # also from a worker's job file


class NonFiniteModel(ValueError):
    """The model's weights stopped being finite: training diverged (no message is to blame)."""


def weights_finite(model: torch.nn.Module) -> bool:
    tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
    return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())  # one copy to host


def starting_model(cfg: StreamTrainConfig, data: TabularDataset, device: torch.device,
                   found: tuple[Path, dict] | None) -> tuple[Architecture, torch.nn.Module]:
    """The architecture and the model built on ``device``: the checkpoint ``found`` (its path and state) gives both
    (its weights are loaded unless sharded: the engine loads those), else ``initial_weights``."""
    init_state = None
    if found is not None:
        path, state = found
        arch = state.get("architecture") or {"hidden": cfg.hidden, "dropout": cfg.dropout, "seed": cfg.seed}
        architecture = Architecture.from_dict(arch, f"checkpoint {path}")
    else:
        architecture, init_state = initial_weights(cfg)
    model = architecture.build(data).to(device)
    if init_state is not None:
        try:
            model.load_state_dict(init_state)
        except RuntimeError as err:
            raise ValueError(f"--init-weights {cfg.init_weights} ({architecture.source}) does not fit "
                             f"the dataset {cfg.dataset_dir}: {str(err).splitlines()[0]}") from None
    if not weights_finite(model):  # a model that would train and publish NaN
        raise NonFiniteModel(f"the starting weights ({architecture.source}) are not finite; start from a "
                             f"model.pt or checkpoint whose weights are")
    if found is not None and not found[1].get("sharded_state"):
        model.load_state_dict(found[1]["model"])  # before the engine: a grid cuts the model it is given
    return architecture, model


def initial_weights(cfg: StreamTrainConfig) -> tuple[Architecture, dict | None]:
    """The architecture and starting weights: ``init_weights``' batch run, else ``cfg``'s sizes."""
    if not cfg.init_weights:
        return Architecture("mlp", cfg.hidden, cfg.dropout, cfg.seed, "the stream trainer's options"), None
    path = Path(cfg.init_weights)
    if not path.is_file():
        raise ValueError(f"--init-weights {path}: no such file; give the model.pt of a `flowtrain batch` run")
    state = torch.load(path, weights_only=True, map_location="cpu")
    if isinstance(state, dict) and isinstance(state.get("model"), dict) and isinstance(state.get("config"), dict):
        return Architecture.from_dict(state["config"], f"checkpoint {path}"), state["model"]  # a batch checkpoint
    if isinstance(state, dict) and state.get("sharded_state"):  # a --shard-states batch run's: each rank's pieces
        raise ValueError(f"--init-weights {path} is a checkpoint of a --shard-states run (its weights are sharded in "
                         f"{state['sharded_state']}); give that run's model.pt, which is whole")
    run_config = RunFiles(path.parent).config
    if not run_config.is_file():
        raise ValueError(f"--init-weights {path}: no config.json beside it, so the batch run's architecture "
                         f"(hidden sizes, dropout, seed) is unknown; give the model.pt of a `flowtrain batch` run "
                         f"directory (or one of its checkpoints)")
    recorded = json.loads(run_config.read_text())
    train = recorded.get("train", recorded)  # config.json: the run's options (flat), or {"train": ...} before
    check_same_dataset(path, Path(recorded.get("dataset") or RunFiles(path.parent).dataset), cfg.dataset_dir)
    return Architecture.from_dict(train, f"batch run {path.parent}"), state


def check_same_dataset(weights: Path, trained_on: Path, dataset: str) -> None:
    """--init-weights from a batch run on another dataset (another label, columns, classes, vocabularies
    or statistics: weights that would read the features wrongly) is an error naming both."""
    if not (trained_on / "_manifest.json").is_file():
        return  # the run's dataset is not at hand: the weights' shapes are still checked on loading
    theirs, mine = read_manifest(trained_on), read_manifest(dataset)
    differ = [name for name, a, b in (("spec", theirs.get("spec"), mine.get("spec")),
                                      ("classes", theirs["stats"].get("classes"), mine["stats"].get("classes")),
                                      ("vocabularies", theirs["stats"].get("vocab"), mine["stats"].get("vocab")))
              if a != b]
    a, b = theirs["stats"].get("numeric", {}), mine["stats"].get("numeric", {})
    if set(a) != set(b) or any(not math.isclose(a[c][k], b[c][k], rel_tol=1e-6, abs_tol=1e-9)
                               for c in a for k in ("mean", "std")):
        differ.append("numeric statistics")
    if differ:
        raise ValueError(f"--init-weights {weights}: that run was trained on the dataset {trained_on}, whose "
                         f"{', '.join(differ)} differ from --dataset {dataset}; start from a batch run on the same "
                         f"dataset (or leave --init-weights out)")
