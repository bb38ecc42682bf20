"""An --input that is a folder (e.g. a run's dataset/) is one line naming it and what to give instead, in every
command that reads input files (batch, predict, drift, replay, features), not a traceback from the format guess."""
from __future__ import annotations

import pytest

from pipelines.tabular.preflight import expand_inputs
from pipelines.tabular.schema import SchemaError


def test_a_folder_given_as_input_is_named_with_the_glob_to_give(tmp_path):
    (tmp_path / "part-0.parquet").write_bytes(b"")
    with pytest.raises(SchemaError, match=r"is a directory, not a file; give its files .*\*\.parquet"):
        expand_inputs([str(tmp_path)])
    assert expand_inputs([str(tmp_path / "*.parquet")]) == [str(tmp_path / "part-0.parquet")]
    with pytest.raises(SchemaError, match="matches no file"):
        expand_inputs([str(tmp_path / "*.csv")])
