"""In-unit checkpoints: model variables, optimizer variables and the position.

A checkpoint is ``checkpoint.h5`` in the slot directory (plus ``checkpoint.json``, a
small human-readable summary whose modification time also tells BOINC's wrapper,
through its ``<checkpoint_filename>``, that the task has checkpointed).

The HDF5 file is written to a temporary name, fsynced and renamed over the old one,
so a crash leaves either the previous or the new checkpoint, never a mix. It holds
every array bit for bit in its own dtype (int64 optimizer step counters and RNG
states included) and a SHA-256 over the arrays and the position: a file that h5py
can still open but whose bytes were damaged is detected and ignored. The batch
order is derived from the unit's seed, so the position (local epoch, batch) is all
that is needed to continue with exactly the batches an uninterrupted run takes.

This module knows nothing about TensorFlow: it stores named groups of numpy arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py
import numpy as np

from boinc_dl.client_app.boinc_io import atomic_write_json

CKPT_H5 = "checkpoint.h5"
CKPT_JSON = "checkpoint.json"
FORMAT = "boinc-dl-checkpoint"
FORMAT_VERSION = 1


class CheckpointInvalid(Exception):
    """The checkpoint file exists but cannot be used (truncated, damaged, wrong layout)."""


@dataclass
class Position:
    """Where a unit stands; everything besides the arrays that a resume needs."""

    local_epoch: int = 0  # local epoch being trained (== local_epochs when training is over)
    batch: int = 0  # next batch index inside ``local_epoch``
    done: int = 0  # batches trained in the whole unit
    examples_seen: int = 0
    # running sums of the current local epoch (the reported train loss/accuracy)
    loss_sum: float = 0.0
    correct: float = 0.0
    count: int = 0
    # totals carried over restarts
    train_s_total: float = 0.0
    redone_batches: int = 0
    restarts: int = 0


def _digest(groups: dict[str, list[np.ndarray]], pos_json: str) -> str:
    h = hashlib.sha256(pos_json.encode())
    for name in sorted(groups):
        h.update(name.encode())
        for a in groups[name]:
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def save(slot_dir: str | Path, key: str, unit: str, groups: dict[str, list[np.ndarray]], pos: Position) -> None:
    """Atomically write a checkpoint for the unit identified by ``key``."""
    slot = Path(slot_dir)
    path = slot / CKPT_H5
    tmp = slot / f".{CKPT_H5}.{os.getpid()}.tmp"
    pos_json = json.dumps(asdict(pos), sort_keys=True)
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["key"] = key
        f.attrs["unit"] = unit
        f.attrs["position"] = pos_json
        f.attrs["sha256"] = _digest(groups, pos_json)
        for name, arrays in groups.items():
            g = f.create_group(name)
            g.attrs["count"] = len(arrays)
            for i, a in enumerate(arrays):
                g.create_dataset(f"{i:06d}", data=np.asarray(a))
    # fsync before the rename: on a VM that is stopped rather than killed, the page
    # cache may not reach the disk, and the rename must not point at a hole.
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    try:
        dfd = os.open(slot, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # directories cannot be fsynced on every filesystem
    atomic_write_json(
        slot / CKPT_JSON,
        {"unit": unit, "key": key, "local_epoch": pos.local_epoch, "batch": pos.batch, "done": pos.done,
         "time": time.time()},
    )


def load(slot_dir: str | Path, key: str) -> tuple[Position, dict[str, list[np.ndarray]]] | None:
    """Read the checkpoint for ``key``.

    Returns None when there is no checkpoint or it belongs to another unit; raises
    :class:`CheckpointInvalid` (with the reason) when it exists but cannot be trusted.
    """
    path = Path(slot_dir) / CKPT_H5
    if not path.exists():
        return None
    try:
        with h5py.File(path, "r") as f:
            if _attr(f, "format") != FORMAT:
                raise CheckpointInvalid("not a checkpoint file")
            if _attr(f, "key") != key:
                return None
            pos_json = _attr(f, "position")
            groups: dict[str, list[np.ndarray]] = {}
            for name, g in f.items():
                if not isinstance(g, h5py.Group):
                    continue
                n = int(g.attrs.get("count", -1))
                keys = sorted(g.keys())
                if n != len(keys):
                    raise CheckpointInvalid(f"group {name}: {len(keys)} arrays, header says {n}")
                groups[name] = [np.asarray(g[k][()]) for k in keys]
            want = _attr(f, "sha256")
    except CheckpointInvalid:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointInvalid(f"unreadable ({type(e).__name__}: {e})") from None
    if _digest(groups, pos_json) != want:
        raise CheckpointInvalid("checksum mismatch (damaged file)")
    try:
        pos = Position(**json.loads(pos_json))
    except (ValueError, TypeError) as e:
        raise CheckpointInvalid(f"bad position record ({e})") from None
    return pos, groups


def _attr(f: h5py.File, name: str) -> str:
    v = f.attrs.get(name, "")
    return v.decode() if isinstance(v, bytes) else str(v)


def remove(slot_dir: str | Path) -> None:
    """Delete the checkpoint files (after the unit's outputs are written)."""
    for name in (CKPT_H5, CKPT_JSON):
        try:
            (Path(slot_dir) / name).unlink()
        except FileNotFoundError:
            pass
