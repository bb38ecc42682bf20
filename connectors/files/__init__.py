"""Parquet, Avro, CSV and JSON-lines files as Arrow record batches in Beam.

``ReadFromFiles`` splits its work by file and, for Parquet, by row group: each (file, row
group) is one element after a ``Reshuffle``, so a runner reads them in parallel. Elements are
``pyarrow.RecordBatch``es, never rows: on the FnApiRunner a row costs ~3 µs per step, a batch
of thousands of rows about 50 µs.

Text files and bad input. With ``column_types`` (declared types, e.g. ``{"x": pa.float64()}``)
CSV and JSON-lines files are read in blocks (``block_bytes``) and every declared column is
converted to its type in Arrow, a column at a time: a value that does not fit (a word in a
numeric column on line 3,000,000) rejects its row, not the file. Rows that cannot be read at
all (a CSV record with the wrong number of fields, a malformed JSON line) are rejected too.
With ``with_errors=True`` rejected rows are ``DeadLetter``s on the ``errs`` output, their
source ``file:line``; without it the read stops with a ``FileReadError`` naming the file and
line. CSV values may hold quoted newlines (lines are still counted right). A header that
repeats a column name is a ``FileReadError`` naming the file and the names.

Record bounds. A CSV record (quoted newlines included) or a JSON line may be up to
``max_record_bytes`` long (default ``MAX_RECORD_BYTES``, 8 MiB), whatever the block size: a
longer one is a dead letter naming its file and line (its payload: the first KiB), skipped
without being held in memory. A CSV header longer than the bound is a ``FileReadError`` saying so.
CSV files with declared types are cut into blocks at record ends (a newline outside quotes:
RFC 4180 quoting; a quote inside an unquoted field is not supported) and each block is parsed
on its own, so no record ever straddles two blocks.

Avro object container files (``.avro``) are read with fastavro (a Beam dependency), one file per unit;
their columns are typed from the file's own (writer's) schema, as Parquet's are from its schema (``avro_arrow_type``:
``long`` -> int64, ``double`` -> float64, ``string``/``enum`` -> string, ``["null", T]`` -> T nullable,
``timestamp-millis``/``-micros`` -> timestamp UTC, ``date`` -> date32, ``decimal`` -> decimal128); declared types
then apply as for Parquet (a value that does not fit rejects its row). A file that is not Avro, or is truncated
or corrupt, is a ``FileReadError`` naming the file (``check_avro_file`` reads every block's framing first).

``_source_row`` (``with_source=True``) is the row's line number in its file (1-based, the
line where the record starts) for CSV and JSON-lines, and its row index (0-based) for Parquet and Avro.

The package: ``units`` (what the formats share: units, declared types, dead letters, the Beam reading), one module
per format (``parquetio``, ``avroio``, ``csvio``, ``jsonio``: its reader and ``ReadFromX``), and ``read``
(``ReadFromFiles``, ``iter_unit``, ``read_unit``: any format, by file name).
"""
from connectors.files.avroio import ReadFromAvro, avro_arrow_type, avro_head, check_avro_file
from connectors.files.csvio import CSV_NULLS, ReadFromCsv, csv_header, read_csv_header, record_end
from connectors.files.jsonio import ReadFromJsonLines
from connectors.files.parquetio import ReadFromParquet
from connectors.files.read import ReadFromFiles, iter_unit, read_unit
from connectors.files.units import (
    BLOCK_BYTES,
    MAX_RECORD_BYTES,
    SOURCE_FILE,
    SOURCE_ROW,
    FileReadError,
    FileUnit,
    file_format,
    list_units,
    parse_numbers,
)

__all__ = ["ReadFromFiles", "ReadFromParquet", "ReadFromAvro", "ReadFromCsv", "ReadFromJsonLines", "FileUnit",
           "FileReadError", "file_format", "list_units", "read_unit", "iter_unit", "csv_header", "parse_numbers",
           "SOURCE_FILE", "SOURCE_ROW", "CSV_NULLS", "MAX_RECORD_BYTES", "BLOCK_BYTES", "record_end",
           "read_csv_header", "avro_arrow_type", "avro_head", "check_avro_file"]
