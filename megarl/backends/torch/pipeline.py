"""Pipeline parallel execution of one stage module (a `Transformer` after `split_stage`).

Training runs torch.distributed.pipelining's ``Schedule1F1B`` (``scale_grads=False``: gradients
are summed over micro-batches, as the Backend protocol wants). The schedule needs one tensor
shape for every micro-batch of a step, so a step's packed micro-batches share one length (the
longest, see `common_length`), and a stage with static shape metadata is built per step (no
metadata-inference pass, which would call the loss function on placeholder tensors).

No-grad forwards use a plain send/recv chain between neighbouring stages (each micro-batch may
have its own length; results stay on the last stage).

The loss function runs on the last stage only; the schedule passes it ``target`` = the index of
the micro-batch (a [1, 1] int64 tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from megarl.backends.torch.packing import Packed


def common_length(lengths: Sequence[int], multiple: int) -> int:
    """The shared packed length of a step's micro-batches."""
    longest = max([max(n, 1) for n in lengths] or [1])
    return -(-longest // multiple) * multiple


class StageRunner:
    """Runs one pipeline stage of a model across the ``pp_group``.

    stage / num_stages: this rank's stage index and the stage count;
    hidden_size, act_dtype: what flows between stages ([1, T, H] in ``act_dtype``);
    out_width, out_kind: last stage output ([1, T, out_width]; "hidden" or "logits").
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        num_stages: int,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        hidden_size: int,
        act_dtype: torch.dtype,
        out_width: int,
        out_kind: str,
    ) -> None:
        self.module = module
        self.stage = stage
        self.num_stages = num_stages
        self.group = pp_group
        self.device = device
        self.hidden_size = hidden_size
        self.act_dtype = act_dtype
        self.out_width = out_width
        self.out_kind = out_kind
        ranks = dist.get_process_group_ranks(pp_group)
        self.prev = ranks[stage - 1] if stage > 0 else None
        self.next = ranks[stage + 1] if stage < num_stages - 1 else None
        self.last_rank = ranks[-1]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def _meta(self, T: int, *, inputs: bool, grad: bool) -> torch.Tensor:
        if inputs and self.is_first:
            return torch.empty(1, T, dtype=torch.long, device="meta")
        width = self.out_width if (not inputs and self.is_last) else self.hidden_size
        t = torch.empty(1, T, width, dtype=self.act_dtype, device="meta")
        return t.requires_grad_(grad)

    def _kwargs(self, p: Packed) -> dict:
        return {"position_ids": p.position_ids, "segment_ids": p.segment_ids,
                "output": self.out_kind}

    def train(
        self, packed: list[Packed], loss_for: Callable[[torch.Tensor, int], torch.Tensor],
        routing: list[torch.Tensor] | None = None,
    ) -> None:
        """Forward + backward of every micro-batch (1F1B); ``loss_for(output, index)`` is
        called on the last stage. All micro-batches must have the same length. ``routing``:
        each micro-batch's replayed experts [1, T, n_sparse, k] (the model's ``routing``)."""
        T = packed[0].seq_len
        if any(p.seq_len != T for p in packed):
            raise ValueError("pipeline micro-batches of one step must share one packed length")
        M = len(packed)
        stage = PipelineStage(
            self.module,
            self.stage,
            self.num_stages,
            self.device,
            input_args=self._meta(T, inputs=True, grad=not self.is_first),
            output_args=self._meta(T, inputs=False, grad=True),
            group=self.group,
        )

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_for(output, int(target.reshape(-1)[0]))

        schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
        kwargs = {
            "position_ids": torch.cat([p.position_ids for p in packed]),
            "segment_ids": torch.cat([p.segment_ids for p in packed]),
            "output": self.out_kind,
        }
        if routing is not None:  # split over micro-batches like position_ids
            kwargs["routing"] = torch.cat(routing)
        target = torch.arange(M, device=self.device)[:, None] if self.is_last else None
        args = (torch.cat([p.input_ids for p in packed]),) if self.is_first else ()
        schedule.step(*args, target=target, return_outputs=False, **kwargs)

    @torch.no_grad()
    def forward(self, packed: list[Packed], routing: list[torch.Tensor] | None = None
                ) -> list[torch.Tensor]:
        """Outputs ``[1, T_i, out_width]`` of every micro-batch on the last stage (empty list
        elsewhere); ``routing`` as in `train`."""
        outputs: list[torch.Tensor] = []
        pending = []
        for i, p in enumerate(packed):
            if self.is_first:
                x = p.input_ids
            else:
                x = torch.empty(1, p.seq_len, self.hidden_size, dtype=self.act_dtype,
                                device=self.device)
                dist.recv(x, src=self.prev, group=self.group)
            out = self.module(x, **self._kwargs(p),
                              routing=None if routing is None else routing[i])
            if self.is_last:
                outputs.append(out)
            else:
                out = out.contiguous()
                pending.append((dist.isend(out, dst=self.next, group=self.group), out))
        for work, _ in pending:
            work.wait()
        return outputs
