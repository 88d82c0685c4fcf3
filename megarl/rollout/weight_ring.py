"""`WeightRing`: ``slots`` copies of a model's weights in one shared-memory file, the way
weights travel from the trainer to its engine processes (`megarl.rollout.process`).

One file holds every slot; a slot holds every tensor at a fixed, 64-byte aligned offset:

    file  = slot 0 | slot 1 | ... | slot s          each ``layout.slot_bytes`` long
    slot  = tensor 0 | pad | tensor 1 | pad | ...   (`RingLayout`: name, dtype, shape, offset)

so a process maps it with one descriptor whatever the number of tensors, and every tensor of
a slot is a view into the mapping. The file lives in ``/dev/shm`` (or the temporary folder
where there is none) under ``megarl-ring-<creator pid>-<random>``; it is unlinked as soon as
every process that reads it has mapped it, so the kernel frees the memory with the last
mapping whatever kills the processes. A file left by a creator killed before that point is
removed by the next ring created on the host.

A ring holds floating-point tensors in the engine's weight dtype (``float_dtype``): a trainer
that keeps fp32 master weights publishes them rounded to the bf16 the engine loads, as the
engine would round them itself (the same round-to-nearest-even cast, so the same bits), in half
the memory and copy time. Host memory: ``slots x (bytes of the weights in the engine's dtype)``
per ring, one ring per node (`megarl.rollout.process` shares it between the node's ranks).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserInputError

ALIGN = 64  # bytes; every tensor starts at a multiple (the widest dtype view needs 8)
PREFIX = "megarl-ring-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]+$")


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor lives in a slot: ``offset`` bytes from the slot's start."""

    name: str
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RingLayout:
    """The tensors of a slot (in stream order), the bytes per slot and the slot count."""

    places: tuple[TensorPlace, ...]
    slot_bytes: int
    slots: int
    float_dtype: str | None = None  # floating tensors are held in it ("bfloat16"); None: as sent

    @property
    def file_bytes(self) -> int:
        return self.slot_bytes * self.slots


def shm_dir() -> Path:
    """Where ring files live: ``/dev/shm`` (memory) where it exists, else the temp folder."""
    dev = Path("/dev/shm")
    return dev if dev.is_dir() and os.access(dev, os.W_OK) else Path(tempfile.gettempdir())


def remove_stale_rings(folder: Path | None = None) -> list[Path]:
    """Unlink the ring files of this host whose creator process is gone; returns them."""
    gone = []
    for path in (folder or shm_dir()).glob(PREFIX + "*"):
        m = _NAME.match(path.name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            path.unlink()
            gone.append(path)
        except FileNotFoundError:
            pass
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight ring: unknown dtype {name!r}")
    return dtype


def held_dtype(t: torch.Tensor, float_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a ring holds ``t`` in: ``float_dtype`` for a floating tensor wider than it (a
    narrower one, e.g. bf16 weights for an fp32 engine, stays: the engine widens it exactly at
    load); anything else its own."""
    if (float_dtype is not None and t.is_floating_point()
            and t.element_size() > float_dtype.itemsize):
        return float_dtype
    return t.dtype


def _raw(t: torch.Tensor) -> Any:
    """``t``'s bytes as a buffer (a numpy view of a contiguous CPU copy; any dtype)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


class WeightRing:
    """A mapped ring file (module doc). Build with `create` (writes slot 0 from the first
    published stream) or `attach` (maps a file another process created)."""

    def __init__(self, path: Path, layout: RingLayout) -> None:
        self.path = Path(path)
        self.layout = layout
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, layout.file_bytes) if layout.file_bytes else None
        finally:
            os.close(fd)  # the mapping keeps the memory
        self._buf = (torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None
                     else torch.empty(0, dtype=torch.uint8))
        self._slots = [self._views(j) for j in range(layout.slots)]

    @classmethod
    def create(cls, weights: Iterable[tuple[str, torch.Tensor]], slots: int,
               float_dtype: torch.dtype | None = None) -> WeightRing:
        """A new ring file of ``slots`` slots whose slot 0 holds the (name, tensor) stream,
        written tensor by tensor as it arrives (no copy of the whole model in between), its
        floating tensors in ``float_dtype`` (`held_dtype`; the engine's weight dtype)."""
        if slots < 1:
            raise ValueError(f"weight ring: slots must be >= 1, got {slots}")
        folder = shm_dir()
        remove_stale_rings(folder)
        path = folder / f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            places, end = [], 0
            for name, tensor in weights:
                tensor = tensor.detach().to(held_dtype(tensor, float_dtype))
                raw = _raw(tensor)
                offset = -(-end // ALIGN) * ALIGN
                _pwrite_all(fd, raw, offset)
                places.append(TensorPlace(name, str(tensor.dtype).removeprefix("torch."),
                                          tuple(tensor.shape), offset, raw.nbytes))
                end = offset + raw.nbytes
            layout = RingLayout(tuple(places), -(-end // ALIGN) * ALIGN, slots,
                                None if float_dtype is None
                                else str(float_dtype).removeprefix("torch."))
            _reserve(fd, folder, layout)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EFBIG):
                raise _short_memory(folder, end, slots) from None
            raise
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            return cls(path, layout)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, path: str | Path, layout: RingLayout) -> WeightRing:
        """Map the ring file ``path`` created by another process."""
        return cls(Path(path), layout)

    def _views(self, slot: int) -> dict[str, torch.Tensor]:
        base = slot * self.layout.slot_bytes
        return {p.name: self._buf[base + p.offset: base + p.offset + p.nbytes]
                .view(_dtype(p.dtype)).view(p.shape) for p in self.layout.places}

    def slot(self, j: int) -> dict[str, torch.Tensor]:
        """Slot ``j``'s tensors (views into the mapping), in stream order."""
        return self._slots[j]

    def write(self, j: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a (name, tensor) stream into slot ``j``; it must carry exactly the tensors of
        the first stream, with their shapes and dtypes (floating ones rounded as `create` did, by
        the copy itself: no rounded copy of the tensor in between)."""
        target, seen = self._slots[j], set()
        float_dtype = None if self.layout.float_dtype is None else _dtype(self.layout.float_dtype)
        for name, tensor in weights:
            view = target.get(name)
            if view is None:
                raise ValueError(f"update_weights: {name!r} was not in the first published "
                                 "stream; every publish must carry the same tensors")
            dtype = held_dtype(tensor, float_dtype)
            if view.shape != tensor.shape or view.dtype != dtype:
                raise ValueError(f"update_weights: {name!r} is {tuple(tensor.shape)} "
                                 f"{dtype}, first published as {tuple(view.shape)} "
                                 f"{view.dtype}")
            view.copy_(tensor.detach())
            seen.add(name)
        if len(seen) != len(target):
            missing = sorted(set(target) - seen)
            raise ValueError(f"update_weights: the stream lacked {missing[:4]}")

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay valid; memory goes with the last one)."""
        self.path.unlink(missing_ok=True)


def _reserve(fd: int, folder: Path, layout: RingLayout) -> None:
    """Give the file all its pages now: a sparse file on a /dev/shm too small for it maps
    fine and kills the process with SIGBUS at the first write past the free memory."""
    try:
        os.posix_fallocate(fd, 0, layout.file_bytes)
    except OSError as e:
        if e.errno != errno.EOPNOTSUPP:  # tmpfs and local file systems support it
            raise
        os.ftruncate(fd, layout.file_bytes)


def _short_memory(folder: Path, slot_bytes: int, slots: int) -> UserInputError:
    """The start-up error for a ``folder`` (normally /dev/shm) that cannot hold the ring."""
    need = slot_bytes * slots
    free = shutil.disk_usage(folder).free
    gib = -(-2 * need // 2**30)  # twice the ring, whole GiB
    return UserInputError(
        f"weight ring: {folder} has {free / 2**20:,.1f} MiB free, the asynchronous rollout's "
        f"ring needs {need / 2**20:,.1f} MiB ({slots} copies of {slot_bytes / 2**20:,.1f} MiB "
        f"of weights, at least): give the job more shared memory (docker run --shm-size="
        f"{gib}g, or a larger /dev/shm mount), or keep fewer copies (a lower "
        "async_training.staleness_threshold)")


def _pwrite_all(fd: int, raw: Any, offset: int) -> None:
    view = memoryview(raw).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
