"""Read an offline wandb run back from its ``run-*.wandb`` file, with wandb's own protobuf
schema: the file is a LevelDB-style log (7-byte ``:W&B`` header, 32 KiB blocks, records split
into FULL / FIRST / MIDDLE / LAST chunks, each behind a 7-byte crc / length / type header) of
serialized ``wandb_internal_pb2.Record`` messages."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, out, partial = 7, [], b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            partial = chunk
        elif kind == _MIDDLE:
            partial += chunk
        elif kind == _LAST:
            out.append(partial + chunk)
    return out


def read_offline_run(wandb_dir: Path, timeout_s: float = 60.0) -> dict:
    """{"project", "name", "config": {key: value}, "history": {step: {metric: value}}} of the
    one offline run under ``wandb_dir`` (its ``wandb/offline-run-*`` folder).

    wandb's service process writes the file; ``run.finish()`` can return before its buffer
    reaches the disk on a loaded machine, so the read waits (up to ``timeout_s``) for the
    run's closing ``exit`` record."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        for raw in _records(path):
            rec = pb.Record()
            rec.ParseFromString(raw)
            records.append(rec)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.2)
    run: dict = {"config": {}, "history": {}}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run["project"], run["name"] = rec.run.project, rec.run.display_name
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in rec.history.item}
            run["history"][rec.history.step.num] = {k: v for k, v in items.items()
                                                    if not k.startswith("_")}
    return run
