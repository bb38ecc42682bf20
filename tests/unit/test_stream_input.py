"""The online trainer's input check and the Arrow IPC size check, without a broker."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from connectors.arrow import encode_batch
from connectors.arrow_ipc import IpcTooLarge, NotArrowIpc, decode_bounded, stream_facts


class _Data:
    """What FeatureMessageCheck reads of a TabularDataset: numeric x, categorical c (3 values), the task."""

    def __init__(self, task: str = "regression", classes: int = 0):
        from connectors.dataset_spec import FeatureSpec

        self.spec = FeatureSpec(label="y", task=task, numeric=["x"], categorical=["c"])
        self.cardinalities = [4]
        self.n_classes = classes


def _message(n: int = 5, **columns) -> pa.Table:
    table = pa.table({"num__x": pa.array(np.linspace(-1, 1, n), pa.float32()),
                      "cat__c": pa.array([i % 4 for i in range(n)], pa.int32()),
                      "label": pa.array([float(i % 2) for i in range(n)], pa.float32()),
                      "source": pa.array([f"raw/0/{i}" for i in range(n)]),
                      "src_partition": pa.array([0] * n, pa.int32()),
                      "src_offset": pa.array(range(n), pa.int64())})
    for name, values in columns.items():
        table = table.set_column(table.schema.get_field_index(name), name, values)
    return table


def _check(task="regression", classes=0, **kw):
    from flowtrain.train.stream.input import FeatureMessageCheck

    return FeatureMessageCheck(_Data(task, classes), **kw)


def test_a_good_message_becomes_tensors_with_its_sources():
    rows = _check()(encode_batch(_message()))
    assert len(rows) == 5 and rows.split.x_num.shape == (5, 1) and rows.split.x_cat.tolist() == [[0], [1], [2], [3],
                                                                                                  [0]]
    assert rows.src_offset.tolist() == [0, 1, 2, 3, 4] and rows.split.y.dtype.is_floating_point


@pytest.mark.parametrize("payload, kind, says", [
    (b"", "not_arrow", "empty message"),
    (b"{\"x\": 1}", "not_arrow", "not an Arrow IPC stream"),
    (encode_batch(_message())[:-40], "not_arrow", "Arrow IPC stream"),
    (encode_batch(_message().drop(["cat__c", "src_offset"])), "schema", "missing column(s) 'cat__c', 'src_offset'"),
    (encode_batch(_message(cat__c=pa.array(["a"] * 5))), "schema", "'cat__c' is string (expected an integer)"),
    (encode_batch(_message(cat__c=pa.array([0, 1, 4, 0, 0], pa.int32()))), "values", "category code 4 at row 2"),
    (encode_batch(_message(cat__c=pa.array([0, -1, 0, 0, 0], pa.int64()))), "values", "category code -1 at row 1"),
    (encode_batch(_message(num__x=pa.array([0, 1, float("nan"), 0, 0], pa.float32()))), "values",
     "'num__x' has 1 value(s) that are not finite"),
    (encode_batch(_message(num__x=pa.array([0, 1e300, 0, 0, 0], pa.float64()))), "values",
     "not finite as float32 (NaN, inf or beyond +-3.4e38), the first 1e+300 at row 1"),
    (encode_batch(_message(label=pa.array([0, 1, float("-inf"), 0, 0], pa.float32()))), "values", "'label'"),
    (encode_batch(_message(num__x=pa.array([0, None, 0, 0, 0], pa.float32()))), "values",
     "'num__x' has 1 null value(s), the first at row 1"),
    (encode_batch(_message(src_offset=pa.array([0, 1, -5, 3, 4], pa.int64()))), "values", "'src_offset' has -5"),
])
def test_each_bad_message_is_rejected_with_its_kind_and_reason(payload, kind, says):
    from flowtrain.train.stream.input import BadFeatureMessage

    with pytest.raises(BadFeatureMessage) as err:
        _check()(payload)
    assert err.value.kind == kind and says in str(err.value), str(err.value)


def test_a_classification_label_must_be_a_class_index():
    from flowtrain.train.stream.input import BadFeatureMessage

    check = _check("classification", classes=3)
    assert len(check(encode_batch(_message(label=pa.array([0, 1, 2, 2, 0], pa.float32()))))) == 5
    for labels, says in (([0, 1, 3, 0, 0], "has 3.0 at row 2, not a class index in [0, 2]"),
                         ([0, 0.5, 1, 0, 0], "has 0.5 at row 1")):
        with pytest.raises(BadFeatureMessage, match=r"'label' " + says.replace("[", r"\[").replace("]", r"\]")
                           .replace(".", r"\.")):
            check(encode_batch(_message(label=pa.array(labels, pa.float32()))))


def _compressed(batch: pa.RecordBatch, codec: str | None = "zstd") -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as writer:
        writer.write_batch(batch)
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("codec", [None, "zstd", "lz4"])
def test_the_decoded_size_is_read_before_decompressing(codec):
    batch = pa.record_batch({"a": pa.array(np.zeros(1 << 20, np.float32)), "b": pa.array(["xy"] * (1 << 20))})
    payload = _compressed(batch, codec)
    facts = stream_facts(payload)
    decoded = 2 * sum(buf.size for col in batch.columns for buf in col.buffers() if buf is not None)
    assert facts.rows == 2 << 20 and facts.decoded_bytes == decoded and facts.compressed == (codec is not None)
    assert decode_bounded(payload, decoded)[0].num_rows == 2 << 20
    with pytest.raises(IpcTooLarge, match=f"decodes to {decoded:,} bytes"):
        decode_bounded(payload, decoded - 1)


def test_a_column_without_buffers_still_counts_its_rows():
    payload = _compressed(pa.record_batch({"n": pa.nulls(10_000_000)}))
    assert stream_facts(payload).decoded_bytes >= 20_000_000
    with pytest.raises(IpcTooLarge):
        decode_bounded(payload, 1 << 20)


def test_damaged_metadata_is_not_arrow():
    payload = bytearray(encode_batch(_message()))
    for cut in (4, 12, len(payload) // 2):
        with pytest.raises(NotArrowIpc):
            stream_facts(bytes(payload[:cut]))
