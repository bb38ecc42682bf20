"""Spill: park a PCollection's record batches in temporary files and read them back later.

A pipeline that needs a full pass over its rows (e.g. training statistics) before it can process
the same rows again would otherwise keep them in the runner between the two passes (Beam's local
runners hold every PCollection that crosses a stage boundary in memory). Instead, the first pass
writes the batches to temporary files and emits only their names; the second pass reads them back::

    spill_dir = spill_directory(output_path)
    names = batches | WriteToSpill(spill_dir)            # one file per key per bundle
    stats = batches | beam.CombineGlobally(...)           # the full pass, in the same stage
    again = names | ReadFromSpill()                       # (key, batch), after stats are ready
    ...   # after the last reader: remove_spill(spill_dir)

Files are Arrow IPC streams (LZ4-compressed buffers): every Arrow type comes back exactly as it
was written, batch boundaries included. Every path goes through Beam's ``FileSystems``, so the
spill works on any runner whose workers reach the output location.
"""
from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from connectors.paths import absolute_path

__all__ = ["WriteToSpill", "ReadFromSpill", "spill_directory", "remove_spill", "remove_stale_spills", "write_spill_file",
           "read_spill_file", "SPILL_SUFFIX"]

#: ``<output>.spill-<id>``: the spill directory sits beside the output it serves.
SPILL_SUFFIX = ".spill-"
_log = logging.getLogger(__name__)
_RAW = CompressionTypes.UNCOMPRESSED  # the IPC buffers are compressed already; never let a name decide


def spill_directory(output_path: str) -> str:
    """A fresh spill directory beside ``output_path`` (any Beam filesystem; a local path made absolute)."""
    return f"{absolute_path(output_path)}{SPILL_SUFFIX}{uuid.uuid4().hex[:12]}"


def remove_spill(directory: str) -> None:
    """Delete a spill directory and everything under it (no error when it is already gone)."""
    if FileSystems.exists(directory):  # a local directory
        FileSystems.delete([directory])
        return
    found = FileSystems.match([FileSystems.join(directory, "**")])[0].metadata_list  # an object store's objects
    if found:
        FileSystems.delete([m.path for m in found])


def remove_stale_spills(output_path: str | os.PathLike) -> list[str]:
    """Delete the spill directories (``<output_path>.spill-*``) a killed job into the local ``output_path``
    left (SIGKILL skips every cleanup); call it when a run of the same output starts, no other job writing
    there. Only a real directory holding nothing but spill files (``*.arrows``, in real sub-directories) is
    deleted; a link or anything else stays, logged. Returns the directories deleted."""
    output = Path(os.path.abspath(output_path))
    gone = []
    for spill in sorted(output.parent.glob(f"{output.name}{SPILL_SUFFIX}*")) if output.parent.is_dir() else []:
        files, foreign = [], []
        if spill.is_symlink() or not spill.is_dir():
            foreign.append(spill.name)
        else:
            for root, dirs, names in os.walk(spill):  # links are not followed (dirs that are links are listed)
                for name in [*names, *dirs]:
                    p = Path(root) / name
                    if p.is_symlink() or (p.is_file() and not name.endswith(".arrows")):
                        foreign.append(str(p.relative_to(spill)))
                    elif p.is_file():
                        files.append(p)
        if foreign:
            _log.warning("left %s in place: it holds what is not a spill file (%s)", spill, ", ".join(foreign[:5]))
            continue
        for f in files:
            f.unlink()
        for root, _dirs, _names in sorted(os.walk(spill), key=lambda w: len(w[0]), reverse=True):
            os.rmdir(root)
        gone.append(str(spill))
    return gone


class _SpillWriter:
    def __init__(self, path: str, schema: pa.Schema):
        self.sink = FileSystems.create(path, mime_type="application/vnd.apache.arrow.stream", compression_type=_RAW)
        self.writer = pa.ipc.new_stream(self.sink, schema, options=pa.ipc.IpcWriteOptions(compression="lz4"))
        self.schema, self.path = schema, path

    def close(self) -> None:
        self.writer.close()
        self.sink.close()


def write_spill_file(path: str, table: pa.Table | pa.RecordBatch) -> None:
    """One table as one spill file (what ``read_spill_file`` reads back)."""
    writer = _SpillWriter(path, table.schema)
    try:
        writer.writer.write(table)
    finally:
        writer.close()


def read_spill_file(path: str) -> pa.Table:
    with FileSystems.open(path, mime_type="application/vnd.apache.arrow.stream", compression_type=_RAW) as fh:
        return pa.ipc.open_stream(fh).read_all()


class _WriteToSpillFn(beam.DoFn):
    """(key, batch) -> one file per key per bundle; emits (key, path) when the bundle ends."""

    def __init__(self, directory: str):
        self._dir = directory

    def start_bundle(self):
        self._writers: dict = {}  # key -> the open writer of this key's current schema
        self._done: list = []

    def process(self, element):
        key, batch = element
        if batch.num_rows == 0:
            return
        writer = self._writers.get(key)
        if writer is None or not writer.schema.equals(batch.schema):
            if writer is not None:  # a batch of another schema (e.g. a column null so far): a new file
                self._done.append((key, writer))
            writer = self._writers[key] = _SpillWriter(FileSystems.join(self._dir, f"{uuid.uuid4().hex}.arrows"),
                                                       batch.schema)
        writer.writer.write_batch(batch)

    def finish_bundle(self) -> Iterator[WindowedValue]:
        for key, writer in [*self._done, *self._writers.items()]:
            writer.close()
            yield WindowedValue((key, writer.path), GlobalWindow().max_timestamp(), [GlobalWindow()])
        self._writers, self._done = {}, []


class WriteToSpill(beam.PTransform):
    """``(key, RecordBatch)`` pairs -> ``(key, path)`` of the spill files holding them.

    The batches are written where they are (fused into the producing stage); only the names cross
    to the next stage. Give the names to ``ReadFromSpill`` once what must come first is done.
    """

    def __init__(self, directory: str):
        super().__init__()
        self._dir = directory

    def expand(self, pairs):
        return pairs | "Spill" >> beam.ParDo(_WriteToSpillFn(self._dir))


def _read_spill(element):
    key, path = element
    with FileSystems.open(path, mime_type="application/vnd.apache.arrow.stream", compression_type=_RAW) as fh:
        for batch in pa.ipc.open_stream(fh):
            yield key, batch


class ReadFromSpill(beam.PTransform):
    """``(key, path)`` from ``WriteToSpill`` -> ``(key, RecordBatch)`` as written (files spread over
    workers first). The files stay until ``remove_spill``: a retried bundle can read them again."""

    def expand(self, names):
        return (names
                | "SpreadFiles" >> beam.Reshuffle()
                | "Read" >> beam.FlatMap(_read_spill))
