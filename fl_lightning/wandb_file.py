"""Reads a W&B run file (`run-<id>.wandb`, what `wandb sync` uploads) as far as it is written.

The file is a LevelDB-style log of protobuf `Record`s: a 7-byte header, then 32 KiB blocks of
chunks, each with a 7-byte header (CRC32 of its type and data, length, type: full, first, middle or
last piece of a record). W&B's service writes it on its own schedule, so a reader may find a chunk
half written: reading stops at the first chunk whose CRC does not match.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

MAGIC = b":W&B"
FILE_HEADER = 7
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(run_file: Path) -> list:
    """The complete `Record`s the file holds so far, in order (none while its header is unwritten)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    if data[:len(MAGIC)] != MAGIC:
        return []
    position, pieces, found = FILE_HEADER, b"", []
    while position + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < CHUNK_HEADER:  # block trailer: zero padding
            position += left_in_block
            continue
        crc, length, kind = struct.unpack("<IHB", data[position:position + CHUNK_HEADER])
        chunk = data[position + CHUNK_HEADER:position + CHUNK_HEADER + length]
        if len(chunk) < length or zlib.crc32(bytes([kind]) + chunk) != crc:
            break  # not written yet, or zeros past the last record
        position += CHUNK_HEADER + length
        if kind == FULL:
            found.append(chunk)
        elif kind == FIRST:
            pieces = chunk
        elif kind == MIDDLE:
            pieces += chunk
        elif kind == LAST:
            found.append(pieces + chunk)
    parsed = []
    for raw in found:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def history_steps(records: list) -> list[int]:
    """The `_step` of every history row among `records`, in order."""
    steps = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            steps += [int(item.value_json) for item in record.history.item
                      if (item.key or ".".join(item.nested_key)) == "_step"]
    return steps


def is_finished(records: list) -> bool:
    """Whether the run's exit record, the last one W&B writes for a finished run, is among `records`."""
    return any(record.WhichOneof("record_type") == "exit" for record in records)
