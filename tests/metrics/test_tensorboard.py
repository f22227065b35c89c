"""Contract of metrics/tfevents.py and the TensorBoard sink: the event files are TFRecords of TensorBoard's `Event`
protocol buffers. Read back here by an independent decoder: the protobuf library, with the messages declared from
TensorBoard's event.proto / summary.proto field numbers, and the CRC checked against the CRC-32C check value."""

from __future__ import annotations

import math
import struct
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from miles_vl.metrics import TensorBoardSink
from miles_vl.metrics.tfevents import crc32c, masked_crc32c

F = descriptor_pb2.FieldDescriptorProto


def _event_class():
    """`tensorboard.Event` as TensorBoard declares it (the fields this project writes), built at run time."""
    proto = descriptor_pb2.FileDescriptorProto(name="tb_event_test.proto", package="tbtest", syntax="proto3")
    value = proto.message_type.add(name="Value")
    value.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
    summary = proto.message_type.add(name="Summary")
    summary.field.add(name="value", number=1, type=F.TYPE_MESSAGE, type_name=".tbtest.Value", label=F.LABEL_REPEATED)
    session = proto.message_type.add(name="SessionLog")
    session.field.add(name="status", number=1, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
    event = proto.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    event.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, type_name=".tbtest.Summary", label=F.LABEL_OPTIONAL)
    event.field.add(
        name="session_log", number=6, type=F.TYPE_MESSAGE, type_name=".tbtest.SessionLog", label=F.LABEL_OPTIONAL
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tbtest.Event"))


Event = _event_class()


def read_events(path: Path) -> list:
    """Every Event of an event file, each record's length and data checked against their CRCs."""
    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        header = data[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8 : at + 12])[0] == masked_crc32c(header)
        body = data[at + 12 : at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length : at + 16 + length])[0] == masked_crc32c(body)
        events.append(Event.FromString(body))
        at += 16 + length
    return events


def scalars(events: list) -> dict[int, dict[str, float]]:
    return {e.step: {v.tag: v.simple_value for v in e.summary.value} for e in events if e.summary.value}


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the published check value of CRC-32C (Castagnoli)


def test_the_event_file_reads_back_as_tensorboards_events(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.log({"step": 1, "reward/mean": 0.25, "train/loss": -1.5, "rollout/rounds": 2})
    sink.log({"step": 2, "reward/mean": 0.5, "train/loss": float("nan"), "rollout/rounds": 1})
    sink.close()
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    events = read_events(path)
    assert events[0].file_version == "brain.Event:2"
    got = scalars(events)
    assert got[1] == {"reward/mean": 0.25, "train/loss": -1.5, "rollout/rounds": 2.0}
    assert got[2]["reward/mean"] == 0.5 and math.isnan(got[2]["train/loss"])
    # a resumed run: a new file, opening with a SessionLog START at its first step (TensorBoard drops later points)
    TensorBoardSink(tmp_path, resume_step=2).close()
    (resumed,) = set((tmp_path / "tensorboard").glob("events.out.tfevents.*")) - {path}
    start = read_events(resumed)[1]
    assert start.step == 2 and start.session_log.status == 1
