"""A join's table (``pipelines.features.output.read_table``): a file, a glob or a dataset's directory (every table
file under it, ``_``/``.`` names left out); a Kafka topic is the stream's only and is refused here in one line."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from pipelines.features.declare import DeclarationError
from pipelines.features.output import read_table


def test_a_dataset_directory_reads_every_table_file_under_it_and_leaves_out_its_metadata(tmp_path):
    (tmp_path / "tier=a").mkdir()
    pq.write_table(pa.table({"merchant": ["m0"], "risk": [1]}), tmp_path / "tier=a" / "part-0.parquet")
    pq.write_table(pa.table({"merchant": ["m1"], "risk": [2]}), tmp_path / "part-1.parquet")
    (tmp_path / "_manifest.json").write_text("{}")
    (tmp_path / ".part-2.parquet.crc").write_text("x")
    (tmp_path / "_tmp").mkdir()
    pacsv.write_csv(pa.table({"merchant": ["zz"], "risk": [9]}), tmp_path / "_tmp" / "p.csv")
    table = read_table(str(tmp_path))
    assert sorted(zip(table.column("merchant").to_pylist(), table.column("risk").to_pylist())) == [("m0", 1),
                                                                                                  ("m1", 2)]
    assert read_table(str(tmp_path) + "/").num_rows == 2
    assert read_table(str(tmp_path / "part-1.parquet")).num_rows == 1


def test_an_empty_directory_and_a_topic_are_refused_naming_them(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="a directory without a table file"):
        read_table(str(tmp_path / "empty"))
    with pytest.raises(DeclarationError, match="a Kafka topic joins on the stream only"):
        read_table("kafka://merchants")
