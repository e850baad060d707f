"""Reading W&B's run file (`run-<id>.wandb`): every record of a finished offline run, records split over
blocks, the end of a block too short for a chunk; a file read while it is written (cut anywhere, a
damaged chunk, zeros past its end) gives the complete records before that point and nothing else; and
the history steps and the run's end found among records."""

import json
import struct
import zlib
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as pb

from fl_lightning.wandb_file import BLOCK, FULL, MAGIC, history_steps, is_finished, read_records

pytestmark = pytest.mark.slow  # a real W&B run (offline) and its service

LONG_TEXT = "a" * 70_000
"""A logged value larger than two blocks: its record is written as first, middle and last pieces."""


@pytest.fixture(scope="module")
def run_file(tmp_path_factory) -> Path:
    """The file of a real offline run that logged steps 1 to 3, step 1 with LONG_TEXT; complete, since
    W&B's service has exited."""
    import wandb

    folder = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as patch:
        # Everything W&B writes, its own logs included, stays in the test's folder.
        for variable in ["WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"]:
            patch.setenv(variable, str(folder / variable.lower()))
        # W&B reads its variables once per process, until its teardown.
        wandb.teardown()
        try:
            # Without what this file does not need (system metrics, console capture, git, requirements).
            settings = wandb.Settings(x_disable_stats=True, console="off", disable_git=True, save_code=False,
                                      x_save_requirements=False)
            run = wandb.init(mode="offline", dir=folder, project="wandb-file", settings=settings)
            run.log({"text": LONG_TEXT}, step=1)
            run.log({"loss": 0.5}, step=2)
            run.log({"loss": 0.25}, step=3)
            run.finish()
        finally:
            # Waits for the service process to exit: the file is whole afterwards.
            wandb.teardown()
    (path,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    return path


def history(records: list) -> list[dict]:
    # W&B writes a key as a one-part nested_key, older versions as key.
    return [{item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]


def serialised(records: list) -> list[bytes]:
    return [record.SerializeToString() for record in records]


def read_bytes_as_file(data: bytes, folder: Path, name: str = "run-partial.wandb") -> list:
    path = folder / name
    path.write_bytes(data)
    return read_records(path)


def test_a_finished_runs_file_holds_its_history_and_its_end(run_file):
    records = read_records(run_file)
    assert history_steps(records) == [1, 2, 3]
    rows = history(records)
    assert rows[0]["text"] == LONG_TEXT
    assert [row["loss"] for row in rows[1:]] == [0.5, 0.25]
    assert records[-1].WhichOneof("record_type") == "exit"
    assert is_finished(records)
    # Otherwise the long record would not have been split over blocks, which the test is about.
    assert run_file.stat().st_size > 2 * BLOCK


def test_a_file_cut_anywhere_reads_as_the_complete_records_before_the_cut(run_file, tmp_path):
    data = run_file.read_bytes()
    whole = serialised(read_records(run_file))
    counts = []
    for cut in [*range(0, len(data), 1999), len(data) - 1, len(data)]:
        found = serialised(read_bytes_as_file(data[:cut], tmp_path))
        assert found == whole[:len(found)], f"cut at {cut}"
        counts.append(len(found))
    assert counts == sorted(counts)
    assert counts[-2:] == [len(whole) - 1, len(whole)]


def test_a_file_whose_last_record_is_half_written_is_not_finished(run_file, tmp_path):
    records = read_bytes_as_file(run_file.read_bytes()[:-1], tmp_path)
    assert not is_finished(records)
    assert history_steps(records) == [1, 2, 3]


def test_a_damaged_byte_reads_as_the_file_cut_there(run_file, tmp_path):
    # A chunk whose CRC does not match is where reading stops, as for a chunk not written yet.
    data = run_file.read_bytes()
    for position in [7, 8, 13, 100, *range(1_000, len(data), 4_999), BLOCK + 3, 2 * BLOCK + 10, len(data) - 1]:
        damaged = bytearray(data)
        damaged[position] ^= 0x40
        assert serialised(read_bytes_as_file(bytes(damaged), tmp_path, "damaged.wandb")) == \
            serialised(read_bytes_as_file(data[:position], tmp_path, "cut.wandb")), f"damage at {position}"


@pytest.mark.parametrize("zeros", [1, 6, 7, 100, BLOCK])
def test_zeros_past_the_last_record_are_no_records(run_file, tmp_path, zeros):
    whole = serialised(read_records(run_file))
    assert serialised(read_bytes_as_file(run_file.read_bytes() + bytes(zeros), tmp_path)) == whole


@pytest.mark.parametrize("start", [b"", b":W", b":W&", b"\0" * 7, b"W&B:\xe1\xbe\x00"])
def test_a_file_without_its_header_holds_no_records(run_file, tmp_path, start):
    # The records of the real file, after a header not (yet) written as W&B writes it.
    chunks = run_file.read_bytes()[7:]
    assert read_bytes_as_file(start, tmp_path) == []
    if len(start) == 7:
        assert read_bytes_as_file(start + chunks, tmp_path) == []


def chunk(kind: int, payload: bytes) -> bytes:
    """A chunk as the format lays it out: CRC32 of its type and data, its length, its type, its data."""
    return struct.pack("<IHB", zlib.crc32(bytes([kind]) + payload), len(payload), kind) + payload


def history_record(step: int, padding: int) -> pb.Record:
    record = pb.Record()
    record.history.item.add(key="_step", value_json=str(step))
    record.history.item.add(key="note", value_json=json.dumps("x" * padding))
    return record


def test_the_end_of_a_block_too_short_for_a_chunk_header_is_skipped(run_file, tmp_path):
    header = run_file.read_bytes()[:7]
    assert header[:len(MAGIC)] == MAGIC
    # The first record fills the first block but for 3 bytes, less than a chunk header: the writer pads
    # them with zeros and starts the next chunk at the next block.
    size = BLOCK - 3 - len(header) - 7
    padding = size
    while history_record(1, padding).ByteSize() > size:
        padding -= 1
    first = history_record(1, padding)
    assert first.ByteSize() == size
    last = pb.Record()
    last.exit.exit_code = 0
    data = header + chunk(FULL, first.SerializeToString()) + bytes(3) + chunk(FULL, last.SerializeToString())
    assert len(data) == BLOCK + 7 + last.ByteSize()

    path = tmp_path / "padded.wandb"
    path.write_bytes(data)
    records = read_records(path)
    assert serialised(records) == [first.SerializeToString(), last.SerializeToString()]
    assert history_steps(records) == [1]
    assert is_finished(records)


def records_of(*kinds_and_steps) -> list:
    records = []
    for kind, steps in kinds_and_steps:
        record = pb.Record()
        if kind == "history":
            for key, value in steps:
                record.history.item.add(key=key, value_json=json.dumps(value))
        elif kind == "nested history":
            for key, value in steps:
                record.history.item.add(nested_key=key.split("."), value_json=json.dumps(value))
        elif kind == "exit":
            record.exit.exit_code = steps
        elif kind == "summary":
            record.summary.update.add(key="_step", value_json=json.dumps(steps))
        records.append(record)
    return records


def test_history_steps_are_the_step_of_every_history_row_in_order():
    records = records_of(
        ("history", [("loss", 1.0), ("_step", 4)]),
        ("summary", 99),  # a summary's _step is no history row
        ("nested history", [("_step", 5), ("train.loss", 0.5)]),
        ("history", [("_stepping", 7), ("_step", 6)]),
        ("history", [("round", 8)]),  # a row without a step adds none
    )
    assert history_steps(records) == [4, 5, 6]
    assert history_steps([]) == []


def test_a_run_is_finished_once_its_exit_record_is_among_the_records():
    unfinished = records_of(("history", [("_step", 1)]), ("summary", 1))
    assert not is_finished(unfinished)
    assert not is_finished([])
    assert is_finished(unfinished + records_of(("exit", 0)))
    # A run that failed also ends with its exit record.
    assert is_finished(records_of(("exit", 1), ("summary", 1)))
