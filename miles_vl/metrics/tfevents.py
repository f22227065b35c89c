"""TensorBoard's event files, written without TensorFlow, tensorboard or tensorboardX (none is a dependency).

An event file (`events.out.tfevents.<time>.<host>`) is a sequence of TFRecords, each holding one serialized `Event`
protocol buffer (tensorboard/compat/proto/event.proto, summary.proto). A TFRecord is: the data's length (uint64,
little-endian), the masked CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data. The messages and fields
written here, by field number:

    Event:   1 wall_time (double), 2 step (int64), 3 file_version (string), 5 summary (Summary),
             6 session_log (SessionLog)
    Summary: 1 value (repeated Value)
    Value:   1 tag (string), 2 simple_value (float)
    SessionLog: 1 status (enum; 1 = START)

The first event of a file names the format version ("brain.Event:2"). A resumed run writes a new file that starts
with a SessionLog START at the first step it writes: TensorBoard then drops the points of that step and later from the
earlier files (a run killed after logging steps past its checkpoint writes them again).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # the Castagnoli polynomial, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC TFRecords store: rotated and offset, so that a CRC of data holding CRCs is not degenerate."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


# -- protocol buffer wire format: varint (0), 64-bit (1), length-delimited (2), 32-bit (5) -----------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: negatives as their two's complement
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def event(
    wall_time: float,
    step: int | None = None,
    *,
    file_version: str | None = None,
    scalars: dict[str, float] | None = None,
    session_start: bool = False,
) -> bytes:
    """One serialized `Event` (module docstring)."""
    out = _key(1, 1) + struct.pack("<d", wall_time)
    if step is not None:
        out += _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value))
            for tag, value in scalars.items()
        )
        out += _bytes_field(5, values)
    if session_start:
        out += _bytes_field(6, _key(1, 0) + _varint(1))
    return out


class EventFileWriter:
    """Scalars by step into a new event file in `log_dir`; each record is flushed as it is written (a killed run
    keeps what it logged). `first_step`: on a resume, the first step this file writes (module docstring)."""

    def __init__(self, log_dir: str | Path, first_step: int | None = None):
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = log_dir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
        n = 1
        while self.path.exists():  # two starts in one second: TensorBoard reads every file of the folder
            n += 1
            self.path = log_dir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{n}"
        self.file = self.path.open("xb")
        self._write(event(now, file_version="brain.Event:2"))
        if first_step is not None:
            self._write(event(now, first_step, session_start=True))

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._write(event(time.time(), step, scalars=scalars))

    def _write(self, data: bytes) -> None:
        self.file.write(tfrecord(data))
        self.file.flush()

    def close(self) -> None:
        self.file.close()
