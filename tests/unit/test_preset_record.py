"""A bad ``--preset`` is an error naming it and the known presets before the run directory is made or marked
(h6 item 6: it left a run marked failed). The preset's name in its dataset's manifest:
tests/integration/test_preset_manifest.py."""
from __future__ import annotations

import json
import os

import pytest

import flowtrain
from flowtrain.cli import main

pytestmark = pytest.mark.timeout(300)


def test_a_bad_preset_is_an_error_before_the_run_directory_is_marked(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(flowtrain.FlowtrainError, match=r"preset \(--preset\): no dataset preset named 'BAD' "
                                                       r"\(registered: .*flights.*\); register yours"):
        flowtrain.batch(preset="BAD", out=str(out))
    assert not out.exists()  # neither made nor marked failed
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"format": "flowtrain.run/1", "run_id": "r1", "command": "batch",
                                              "status": "complete", "options": {}, "options_hash": "x"}))
    before = (out / "run.json").read_text()
    with pytest.raises(SystemExit) as stopped:  # the command line's parser: the same message
        main(["batch", "--preset", "BAD", "--out", str(out)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "no dataset preset named 'BAD'" in err and "flights" in err and len(err.splitlines()) == 1, err
    assert (out / "run.json").read_text() == before and sorted(os.listdir(out)) == ["run.json"]
