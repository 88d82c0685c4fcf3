"""The weight stream: new actor weights from trainer rank 0 to every rollout worker
(docs/design.md, "The weight stream and versions").

The trainer and the workers form a process group of their own, beside the trainer's default
one: a TCPStore served by trainer rank 0, a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL`
(GPU) built on it directly, rank 0 the sender. A publish streams the (HF name, full tensor)
pairs of ``actor.export_weights()``, cast to the engines' dtype, in the buckets of
`megarl.rollout.reshard.weight_buckets`: each bucket's header (names, shapes, dtypes) goes to
every worker on its control channel, then the bucket's bytes go out in one broadcast. A worker
stages the tensors and applies them between decode steps (`megarl.rollout.worker`); it then
reports the version it runs and, when asked, a digest of every tensor its engine holds, which
`check_digests` compares with what was sent.

    group = WeightGroup.listen(1 + workers, device, timeout_s)          # trainer rank 0
    group = WeightGroup.join(host, port, rank, size, device, timeout_s)  # a worker
    group.form()                                                         # rank 0, then
    sent = send_weights(group, channels, named_tensors, version, bucket_bytes, engine_dtype)
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.rollout.channel import Channel
from megarl.rollout.reshard import tensor_bytes, weight_buckets


class WeightGroupError(RuntimeError):
    """The weight group could not form, or a broadcast on it failed (a member is gone)."""


class WeightDigestError(RuntimeError):
    """An engine holds other weights than the trainer sent (the run must stop)."""


@dataclass
class WeightGroup:
    """A process group of the trainer's rank 0 (rank 0) and the rollout workers (1..size-1),
    built from a TCPStore of its own (module doc)."""

    store: Any
    pg: Any
    rank: int
    size: int
    device: torch.device
    host: str = "127.0.0.1"
    timeout_s: float = 1800.0
    generation: int = 0  # how many times the group was formed again (without lost members)

    @property
    def port(self) -> int:
        return int(self.store.port)

    @classmethod
    def listen(cls, size: int, device: torch.device | str, timeout_s: float,
               host: str = "127.0.0.1") -> WeightGroup:
        """Rank 0's store on a free port of ``host``; `form` builds the group once the
        workers know the port."""
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, None, 0, size, torch.device(device), host, timeout_s)

    @classmethod
    def join(cls, host: str, port: int, rank: int, size: int, device: torch.device | str,
             timeout_s: float) -> WeightGroup:
        """A worker's member (rank >= 1) of the group whose store rank 0 serves at
        ``host:port``."""
        try:
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistStoreError) as e:
            raise WeightGroupError(f"the weight group's store at {host}:{port} did not answer "
                                   f"within {timeout_s:g} s ({e})") from None
        group = cls(store, None, rank, size, torch.device(device), host, timeout_s)
        group.form()
        return group

    def form(self) -> None:
        """Build the process group (collective over its ``size`` members)."""
        prefixed = dist.PrefixStore(f"megarl/weights/{self.generation}", self.store)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            if self.device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(prefixed, self.rank, self.size, timeout)
        except (RuntimeError, dist.DistStoreError) as e:
            raise WeightGroupError(
                f"the weight group (rank {self.rank} of {self.size}) did not form within "
                f"{self.timeout_s:g} s: a member never joined ({e})") from None

    def reform(self, rank: int, size: int, generation: int) -> None:
        """Form the group again as ``rank`` of ``size`` (the members left after a loss), on
        keys of its own (``generation``); collective over the new members."""
        self.pg = None
        self.rank, self.size, self.generation = rank, size, generation
        self.form()

    def broadcast(self, buf: torch.Tensor) -> None:
        """``buf`` [nbytes] uint8 from rank 0 into every member's ``buf`` (on ``device``)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.pg.broadcast([buf], opts).wait()
        except (RuntimeError, dist.DistError) as e:
            raise WeightGroupError(f"a weight broadcast on the weight group failed (a member "
                                   f"is gone, or silent for {self.timeout_s:g} s): {e}") from None

    def close(self) -> None:
        self.pg = None
        self.store = None


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``str(dtype)`` (``"torch.bfloat16"``), as headers and hellos carry it."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (C order, its own dtype)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass
class Sent:
    """What one publish sent: its version, bytes (in the engines' dtype), and each tensor's
    digest (when asked for)."""

    version: int
    nbytes: int
    digests: dict[str, str]


def send_weights(group: WeightGroup, channels: list[Channel],
                 named: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int,
                 engine_dtype: torch.dtype | None = None, digest: bool = False) -> Sent:
    """Rank 0: stream ``named`` (floating tensors cast to ``engine_dtype``, the dtype the
    engines hold) to every worker on ``channels``, one bucket header each, then the bucket's
    broadcast; then tell them ``version`` is complete. ``digest``: digest each tensor sent and
    ask the workers for the digests of what their engines hold."""
    total, digests = 0, {}
    for bucket in weight_buckets(named, bucket_bytes, dtype=engine_dtype, device=group.device):
        header = {"entries": [(n, tuple(t.shape), str(t.dtype)) for n, t in bucket],
                  "nbytes": sum(tensor_bytes(t) for _, t in bucket)}
        for ch in channels:
            ch.send("weights_bucket", header)
        group.broadcast(torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8)
                                   for _, t in bucket]))
        total += header["nbytes"]
        if digest:
            digests.update((n, tensor_digest(t)) for n, t in bucket)
    for ch in channels:
        ch.send("weights_end", {"version": version, "digest": digest})
    return Sent(version, total, digests)


def receive_bucket(group: WeightGroup, header: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """A worker: join the broadcast of the bucket ``header`` announced; its tensors."""
    buf = torch.empty(int(header["nbytes"]), dtype=torch.uint8, device=group.device)
    group.broadcast(buf)
    out, offset = [], 0
    for name, shape, dtype_name in header["entries"]:
        dtype = wire_dtype(dtype_name)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        out.append((name, buf[offset:offset + n].view(dtype).reshape(shape).clone()))
        offset += n
    return out


def check_digests(sent: Sent, reported: dict[str, str], worker: str) -> None:
    """Fail naming the first tensor whose digest in ``worker``'s engine differs from what was
    sent (a tensor the engine does not hold separately, e.g. a tied lm_head, is skipped)."""
    for name, digest in sent.digests.items():
        if name in reported and reported[name] != digest:
            raise WeightDigestError(
                f"weight digest mismatch: {worker} holds {name} with sha256 "
                f"{reported[name][:16]}..., the trainer sent {digest[:16]}... (version "
                f"{sent.version}): the weights were corrupted in transfer or loading")
    missing = sorted(set(sent.digests) - set(reported))
    if missing and len(missing) == len(sent.digests):
        raise WeightDigestError(f"{worker} reported no digest of the {len(missing)} tensors sent "
                           f"(version {sent.version})")
