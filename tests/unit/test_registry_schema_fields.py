"""Issue 30 item 2 (task h5 item 3): ``flowtrain registry`` and ``flowtrain schema`` take their options as fields
(``connectors.fields``) like every other command: the same flags, plus ``--config`` and ``--print-config``, and
jobs runnable from Python (``flowtrain.commands.local.RegistryJob``, ``flowtrain.commands.stream.schema.SchemaJob``)."""
from __future__ import annotations

import json

import pytest
import yaml

from connectors.dataset import FORMAT, MANIFEST
from connectors.dataset_spec import FeatureSpec
from connectors.fields import build, options_of
from flowtrain.cli.main import main
from flowtrain.commands.local import ACTIONS, RegistryJob, RegistryStartJob, run_registry
from flowtrain.commands.stream.schema import SchemaJob, run_schema

SPEC = FeatureSpec(label="y", task="regression", numeric=["temp", "pressure"], categorical=["state"])


@pytest.fixture
def dataset(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"format": FORMAT, "spec": SPEC.to_dict(), "stats": {}}))
    return tmp_path


def test_registry_and_schema_options_are_fields_with_their_flags_kept():
    flags = {action: [o.flag for o in options_of(cls)] for action, cls in ACTIONS["registry"].items()}
    assert flags == {"start": ["--port", "--data-dir", "--json", "--timeout"],
                     "stop": ["--port", "--data-dir", "--json"], "status": ["--port", "--data-dir", "--json"]}
    assert [o.flag for o in options_of(SchemaJob)] == ["--dataset", "--format", "--check"]
    assert (RegistryStartJob().port, RegistryStartJob().timeout) == (8081, 120.0)
    with pytest.raises(ValueError, match=r"schema_format \(--format\): 'xml' is not one of avro, protobuf"):
        build(SchemaJob, dataset="d", schema_format="xml")


def test_schema_takes_config_and_print_config(dataset, tmp_path, capsys):
    config = tmp_path / "schema.yaml"
    config.write_text(yaml.safe_dump({"dataset": str(dataset), "schema_format": "protobuf"}))
    assert main(["schema", "--config", str(config), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == {"dataset": str(dataset), "schema_format": "protobuf", "check": None}
    assert main(["schema", "--config", str(config)]) == 0
    assert "optional double temp = " in capsys.readouterr().out
    assert main(["schema", "--config", str(config), "--format", "avro"]) == 0  # the command line wins
    assert json.loads(capsys.readouterr().out)["type"] == "record"
    assert run_schema(SchemaJob(dataset=str(dataset), schema_format="avro")) == 0  # the same job from Python
    assert json.loads(capsys.readouterr().out)["type"] == "record"
    assert main(["schema", "--format", "avro"]) == 2
    assert "--dataset DIR is required" in capsys.readouterr().err


def test_registry_takes_config_and_print_config_and_runs_from_python(tmp_path, capsys):
    config = tmp_path / "registry.yaml"
    config.write_text(yaml.safe_dump({"port": 18123, "data_dir": str(tmp_path / "reg"), "json": True}))
    assert main(["registry", "start", "--config", str(config), "--timeout", "5", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == {"port": 18123, "data_dir": str(tmp_path / "reg"), "json": True,
                                                       "timeout": 5.0}
    assert main(["registry", "status", "--config", str(config)]) == 1  # nothing runs there: status says so
    status = json.loads(capsys.readouterr().out)
    assert status["running"] is False and status["url"] == "http://127.0.0.1:18123/apis/ccompat/v7"
    assert run_registry("status", RegistryJob(port=18123, data_dir=str(tmp_path / "reg"))) == 1
    assert "registry: not running" in capsys.readouterr().out
