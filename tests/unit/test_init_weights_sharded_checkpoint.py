"""`flowtrain stream train --init-weights` given a checkpoint of a `--shard-states` batch run (issue 31)."""
from __future__ import annotations

import pytest
import torch

from connectors.kafka import KafkaTarget, Topics
from flowtrain.train.stream.config import StreamTrainConfig, initial_weights


def test_init_weights_from_a_sharded_checkpoint_is_one_line_naming_the_whole_model(tmp_path):
    """A --shard-states batch run's checkpoint holds no whole model (its shards are per rank): the stream trainer's
    --init-weights names it and asks for the run's model.pt."""
    path = tmp_path / "ckpt-000000008.pt"
    torch.save({"sharded_state": "ckpt-000000008.dcp", "config": {"hidden": [16, 8]}, "step": 8}, path)
    with pytest.raises(ValueError) as err:
        initial_weights(StreamTrainConfig(kafka=KafkaTarget("127.0.0.1:9"), topics=Topics(),
                                          run_dir=str(tmp_path / "r"), dataset_dir="d", init_weights=str(path)))
    assert "--shard-states" in str(err.value) and "model.pt" in str(err.value) and "\n" not in str(err.value)
