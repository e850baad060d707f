"""Reads the history rows of a W&B run file (run-<id>.wandb), as `wandb sync` would upload them.

The file is a LevelDB-style log of protobuf `Record`s: a 7-byte header, then 32 KiB blocks of
chunks, each with a 7-byte header (CRC32, length, type: full, first, middle or last piece).
"""

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(run_file: Path) -> list:
    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    position, pieces, found = 7, b"", []
    while position + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < CHUNK_HEADER:  # block trailer: zero padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + CHUNK_HEADER])
        position += CHUNK_HEADER
        chunk = data[position:position + length]
        position += length
        if kind == FULL:
            found.append(chunk)
        elif kind == FIRST:
            pieces = chunk
        elif kind == MIDDLE:
            pieces += chunk
        elif kind == LAST:
            found.append(pieces + chunk)
        else:
            break  # zeros past the last record written
    parsed = []
    for raw in found:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def history_rows(run_file: Path) -> list[dict]:
    """Every history row in the file, in order, as {key: value} (with W&B's `_step`)."""
    rows = []
    for record in records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append(row)
    return rows
