"""RolloutBatch: the B responses of one step and everything computed about them.

Tensors are padded per batch (prompt left-padded to P, response right-padded to L, both the
largest in the batch) and every rank holds the same full batch once the rollout is gathered.
Per-token tensors are [B, L] aligned with ``response_ids``; per-response tensors are [B].
The one exception is ``routed_experts`` [B, P + L, n_sparse, k] int16 (routing replay of MoE
policies): aligned with the whole ``[prompt | response]`` row, -1 on padding and on tokens the
engine did not route (each response's last token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.backends.protocol import SequenceBatch


@dataclass
class RolloutSample:
    """One response as it leaves the engine (plain lists: cheap to gather across ranks)."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float] | None
    finish_reason: str
    group: int  # global prompt uid: responses of one prompt share it
    data_source: str
    ground_truth: Any
    extra_info: dict
    policy_version: int | None = None  # weights version that sampled it (asynchronous rollout)
    # [len(prompt_ids) + len(response_ids), n_sparse, k] experts of each token (routing replay)
    routed_experts: torch.Tensor | None = None


@dataclass
class PromptItem:
    """One row's prompt as a dataset item: what generation reads (``prompt_ids`` unpadded)."""

    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict


def _pad(rows: list[list], width: int, value, left: bool, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            if left:
                out[i, width - len(row):] = torch.tensor(row, dtype=dtype)
            else:
                out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _routing_rows(samples: list[RolloutSample], P: int, L: int) -> torch.Tensor:
    """[B, P + L, n_sparse, k]: each sample's routing at its prompt's (left-padded) and
    response's (right-padded) columns, -1 elsewhere."""
    first = samples[0].routed_experts
    out = torch.full((len(samples), P + L, *first.shape[1:]), -1, dtype=first.dtype)
    for i, s in enumerate(samples):
        r, n_p = s.routed_experts, len(s.prompt_ids)
        if tuple(r.shape) != (n_p + len(s.response_ids), *first.shape[1:]):
            raise ValueError(
                f"sample {i}: routed_experts has shape {tuple(r.shape)}, expected "
                f"({n_p + len(s.response_ids)}, {', '.join(map(str, first.shape[1:]))}) "
                "(prompt + response tokens, sparse layers, top-k)"
            )
        out[i, P - n_p: P + len(s.response_ids)] = r.to(first.dtype)
    return out


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] int64, left-padded
    prompt_mask: torch.Tensor  # [B, P] int64
    response_ids: torch.Tensor  # [B, L] int64, right-padded
    response_mask: torch.Tensor  # [B, L] float32 (1 on response tokens, EOS included)
    group_index: torch.Tensor  # [B] int64
    data_sources: list[str]
    ground_truths: list[Any]
    extra_infos: list[dict]
    finish_reasons: list[str]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_samples(cls, samples: list[RolloutSample], pad_id: int) -> RolloutBatch:
        P = max(len(s.prompt_ids) for s in samples)
        L = max(1, max(len(s.response_ids) for s in samples))
        prompts = [s.prompt_ids for s in samples]
        responses = [s.response_ids for s in samples]
        batch = cls(
            prompt_ids=_pad(prompts, P, pad_id, left=True, dtype=torch.long),
            prompt_mask=_pad([[1] * len(p) for p in prompts], P, 0, left=True, dtype=torch.long),
            response_ids=_pad(responses, L, pad_id, left=False, dtype=torch.long),
            response_mask=_pad([[1.0] * len(r) for r in responses], L, 0.0, left=False,
                               dtype=torch.float32),
            group_index=torch.tensor([s.group for s in samples], dtype=torch.long),
            data_sources=[s.data_source for s in samples],
            ground_truths=[s.ground_truth for s in samples],
            extra_infos=[s.extra_info for s in samples],
            finish_reasons=[s.finish_reason for s in samples],
        )
        if all(s.rollout_logprobs is not None for s in samples):
            batch.tensors["rollout_logprob"] = _pad(
                [s.rollout_logprobs for s in samples], L, 0.0, left=False, dtype=torch.float32)
        if all(s.policy_version is not None for s in samples):  # [B] int64
            batch.tensors["policy_version"] = torch.tensor([s.policy_version for s in samples],
                                                           dtype=torch.long)
        if all(s.routed_experts is not None for s in samples):
            batch.tensors["routed_experts"] = _routing_rows(samples, P, L)
        return batch

    @property
    def batch_size(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    def sequence_batch(self, keys: tuple[str, ...] = ()) -> SequenceBatch:
        """The backend view: input_ids = [prompt | response], with the named tensors attached
        (``response_mask`` and ``group_index`` always, ``routed_experts`` whenever the batch
        has it: a backend with routing replay on reads it from every batch it is given)."""
        tensors = {k: self.tensors[k] for k in keys}
        tensors["response_mask"] = self.response_mask
        tensors["group_index"] = self.group_index
        if "routed_experts" in self.tensors:
            tensors["routed_experts"] = self.tensors["routed_experts"]
        return SequenceBatch(
            input_ids=torch.cat([self.prompt_ids, self.response_ids], dim=1),
            attention_mask=torch.cat([self.prompt_mask, self.response_mask.long()], dim=1),
            response_length=int(self.response_ids.shape[1]),
            tensors=tensors,
        )

    def select(self, index: list[int] | torch.Tensor) -> RolloutBatch:
        idx = torch.as_tensor(index, dtype=torch.long)
        ids = idx.tolist()
        return RolloutBatch(
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            response_ids=self.response_ids[idx],
            response_mask=self.response_mask[idx],
            group_index=self.group_index[idx],
            data_sources=[self.data_sources[i] for i in ids],
            ground_truths=[self.ground_truths[i] for i in ids],
            extra_infos=[self.extra_infos[i] for i in ids],
            finish_reasons=[self.finish_reasons[i] for i in ids],
            tensors={k: v[idx] for k, v in self.tensors.items()},
        )

    def prompt_item(self, row: int) -> PromptItem:
        """Row ``row``'s prompt (padding removed) with its data source, ground truth and info."""
        mask = self.prompt_mask[row].bool()
        return PromptItem(prompt_ids=self.prompt_ids[row][mask].tolist(),
                          data_source=self.data_sources[row],
                          ground_truth=self.ground_truths[row],
                          extra_info=self.extra_infos[row])

    def group_prompts(self) -> tuple[list[int], list[PromptItem]]:
        """The group ids in order of first appearance and each group's prompt (its first row)."""
        ids = self.group_index.tolist()
        groups = list(dict.fromkeys(ids))
        return groups, [self.prompt_item(ids.index(g)) for g in groups]
