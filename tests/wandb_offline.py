"""Read the records of an offline W&B run (the `run-*.wandb` file, a LevelDB-style log of
protobuf Records), so tests check what would be synced without a W&B server."""

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32768
_HEADER = 7


def read_records(run_file: Path) -> list:
    raw = Path(run_file).read_bytes()
    assert raw[:4] == b":W&B", f"{run_file} is not a W&B run file"
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(raw):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + _HEADER])
        chunk = raw[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def offline_run_files(wandb_dir: Path) -> list[Path]:
    """Run files in the order the runs started (W&B keeps one WANDB_DIR per process)."""
    return sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def artifacts(run_file: Path) -> list:
    return [r.artifact for r in read_records(run_file) if r.WhichOneof("record_type") == "artifact"]


def history_keys(run_file: Path) -> set[str]:
    return {
        item.key or "/".join(item.nested_key)
        for r in read_records(run_file)
        if r.WhichOneof("record_type") == "history"
        for item in r.history.item
    }
