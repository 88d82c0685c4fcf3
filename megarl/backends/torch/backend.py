"""TorchBackend: one role (actor / ref / critic / prm) on megarl's own model with PyTorch's
FSDP2, DTensor tensor parallelism and torch.distributed.pipelining.

Data flow of the no-grad methods (``logprobs``, ``values``, ``token_scores``): every rank holds
the full batch; the rows are split over data-parallel ranks and into micro-batches (by default
contiguous DP shares cut by ``forward_max_tokens`` / ``forward_micro_batch_size``; or the
caller's ``micro_batches`` row lists, see `given_row_split`), each micro-batch is packed into one
row without padding (`packing.pack`), and the results are all-reduced over DP (disjoint rows)
and broadcast from the last pipeline stage, so every rank returns the full ``[B, L]``.

``train_step`` runs the caller's micro-batches as given (same packing), sums gradients over
micro-batches (FSDP averages them over DP ranks), clips by the global norm, and applies one
AdamW update with the scheduled LR; a non-finite grad norm skips the update.

Ulysses sequence parallelism (``ulysses`` > 1, `ulysses`): the U ranks of a sequence-parallel
group take the same rows, each packed micro-batch is padded to a multiple of U and every rank
runs its contiguous token shard; the heads return the full per-token tensors on every rank of
the group, so the loss and metrics are those of U=1, and FSDP2 (sharded over DP x SP) sums the
gradients over the group and averages them over DP.

Bit-identity: a micro-batch gives bit-identical logprobs in ``logprobs`` and inside
``train_step`` (fp32, CPU) because both pack it the same way and run the same modules and
kernel. Under pipeline parallelism a step's micro-batches are padded to their common length,
and ``logprobs`` pads each DP rank's micro-batches the same way, so bit-identity needs the same
per-rank grouping (pass the trainer's split through `interleave_rank_splits`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from megarl.backends.metrics import reduce_metrics
from megarl.backends.protocol import LM_ROLES, ROLES, TRAINABLE_ROLES, LossFn, SequenceBatch
from megarl.backends.routing import check_router_replay, replay_mode
from megarl.backends.settings import RoleSettings
from megarl.backends.torch import checkpoint as ckpt
from megarl.backends.torch import parallelize as par
from megarl.backends.torch.heads import TorchHeadOutputs, lm_outputs, token_scores, value_outputs
from megarl.backends.torch.layout import Layout, build_mesh, fsdp_mesh, world_size
from megarl.backends.torch.moe import pipeline_routing, replay_routing
from megarl.backends.torch.no_grad import forward_no_grad
from megarl.backends.torch.optim import (
    OptimSettings,
    align_grad_placements,
    build_optimizer,
    check_torch_optim,
    clip_grads_,
    set_lr,
    total_grad_norm,
)
from megarl.backends.torch.packing import Packed, empty_batch, pack, packed_length
from megarl.backends.torch.pipeline import StageRunner, common_length
from megarl.backends.torch.precision import held_dtype, param_dtype_key, rounding_notice
from megarl.backends.torch.ulysses import SeqShard
from megarl.backends.torch.weights import adapter_specs, iter_full_weights, weight_specs
from megarl.errors import UserInputError
from megarl.models import ModelArgs, Transformer, hf_config_for, load_model, read_hf_config
from megarl.models.args import num_labels_from_hf_config
from megarl.models.lora import LoraSettings, adapters_disabled, apply_lora, lora_modules
from megarl.models.overrides import override_key
from megarl.utils.dist import sum_over_group
from megarl.utils.dtypes import torch_dtype

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchBackend:
    """A `megarl.backends.protocol.Backend` in plain PyTorch (see module docstring).

    role:        actor | ref | critic | prm. Critic: 1-label ``score`` head (fresh when the
                 checkpoint is an LM); PRM: token classification (``num_labels`` or config.json).
    model_path:  HF folder (config.json + safetensors).
    tp, pp, dp_shard, sp: tensor / pipeline / FSDP sizes (``dp_shard=-1``: world / (tp * pp *
                 ulysses)), sequence parallelism inside TP.
    ulysses:     Ulysses sequence-parallel size (FSDP only: tp = pp = 1). Mesh ("pp",
                 "dp_shard", "ulysses", "tp"), TP innermost.
    dtype:       "fp32" | "bf16": the dtype the model computes in.
    param_dtype: "fp32" | "bf16" | None: the dtype the parameters are held in, and with them
                 the gradients and the AdamW state (`precision`). None: fp32 on a trainable
                 role, ``dtype`` on a frozen one. Parameters held in a wider dtype than
                 ``dtype`` run under FSDP2 mixed precision (compute in ``dtype``, gradients
                 reduced in fp32); bf16 parameters with fp32 compute are refused.
    optim:       `OptimSettings` (or a mapping of its fields: lr, betas, eps, weight_decay,
                 grad_clip (None/0: off), lr_scheduler_type (constant | cosine),
                 lr_warmup_steps (-1: use the ratio), lr_warmup_steps_ratio, min_lr_ratio,
                 total_training_steps), the shape both backends take; megatron-core's
                 override fields are refused.
    activation_checkpointing: recompute each block in backward.
    use_fused_kernels, kernel_impl, chunk_size: logprob/entropy through megarl_kernels
                 (impl "auto" | "torch" | "triton") or the naive log_softmax path.
    forward_max_tokens, forward_micro_batch_size: micro-batching of the no-grad methods.
    router_replay: MoE routing replay: forwards route each token to the experts in the batch's
                 ``routed_experts`` tensor (recorded by the rollout engine) instead of the
                 routers' top-k (`moe.replay_routing`); batches without it route as usual.
                 LM roles of MoE models, every layout (FSDP2, TP, PP, Ulysses).
    lora:        actor only: LoRA adapters (`megarl.models.lora`) on the loaded model; the
                 base is frozen and outside the optimizer, checkpoints hold the adapters (and
                 their optimizer state) only, `export_weights` sends the merged weights,
                 `export_adapter` the adapters, `adapters_off` runs the base model (the
                 reference). Tensor parallelism is refused with it.
    seed:        initialisation of a fresh head (and of the LoRA A matrices).
                 device: default CUDA (current) else CPU.
    With a world of one, fp32 and no parallelism, the model is not wrapped at all.
    """

    def __init__(
        self,
        role: str,
        model_path: str,
        *,
        tp: int = 1,
        pp: int = 1,
        dp_shard: int = -1,
        sp: bool = False,
        ulysses: int = 1,
        dtype: str = "fp32",
        param_dtype: str | None = None,
        optim: OptimSettings | Mapping[str, Any] | None = None,
        activation_checkpointing: bool = False,
        use_fused_kernels: bool = True,
        kernel_impl: str = "auto",
        chunk_size: int | None = None,
        forward_max_tokens: int | None = 16384,
        forward_micro_batch_size: int | None = None,
        num_labels: int | None = None,
        router_replay: bool | str = False,
        lora: LoraSettings | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        hf_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if lora is not None and role != "actor":
            raise ValueError(f"LoRA adapters train on the actor only, not on the {role}")
        self.lora = lora
        self.compute_dtype = torch_dtype(dtype)
        self.role = role
        self.model_path = str(model_path)
        self.trainable = role in TRAINABLE_ROLES
        self.device = torch.device(device) if device is not None else default_device()
        self.layout = Layout.resolve(world_size(), tp=tp, pp=pp, dp_shard=dp_shard, sp=sp,
                                     ulysses=ulysses)
        self.mesh = build_mesh(self.layout, self.device)
        self.param_dtype = held_dtype(self.compute_dtype, param_dtype, self.trainable,
                                      param_dtype_key(role))
        self.optim = check_torch_optim(OptimSettings.coerce(optim))
        if self.trainable and self.param_dtype != torch.float32 and dist.get_rank() == 0:
            logger.warning("%s: %s", role, rounding_notice(self.param_dtype, self.optim.lr,
                                                              param_dtype_key(role)))
        self.kernel = {"fused": use_fused_kernels, "impl": kernel_impl, "chunk_size": chunk_size}
        self.forward_max_tokens = forward_max_tokens
        self.forward_micro_batch_size = forward_micro_batch_size
        self.step = 0  # optimizer updates applied (the LR schedule position)

        self.hf_config = read_hf_config(model_path, hf_overrides, key=override_key(role))
        self.args = ModelArgs.from_hf_config(self.hf_config)
        self.router_replay_mode = replay_mode(router_replay)
        self.router_replay = self.router_replay_mode != "disabled"
        if self.router_replay:
            check_router_replay(self.args, role, self.router_replay_mode)
        self._shard = self._seq_shard()
        self.head = "lm" if role in LM_ROLES else "token_cls"
        self.num_labels = None
        if role == "critic":
            self.num_labels = 1
        elif role == "prm":
            self.num_labels = num_labels or num_labels_from_hf_config(self.hf_config)
        self.model = self._build_model(model_path, activation_checkpointing, seed)
        self.optimizer = None
        if self.trainable:
            self.optimizer = build_optimizer(self._params(), self.optim)
        else:
            self.model.requires_grad_(False)
            self.model.eval()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_settings(cls, settings: RoleSettings, **overrides: Any) -> TorchBackend:
        """A backend for ``settings.role`` (`megarl.trainer.settings.role_settings`; see
        `backends.torch.config`); ``overrides`` replace constructor arguments."""
        from megarl.backends.torch.config import backend_kwargs

        path, kwargs = backend_kwargs(settings)
        kwargs.update(overrides)
        return cls(settings.role, path, **kwargs)

    def _build_model(self, path: str, ac: bool, seed: int) -> Transformer:
        lay = self.layout
        model = load_model(
            path, head=self.head, num_labels=self.num_labels, dtype=self.param_dtype,
            device="cpu", allow_new_head=self.role == "critic",
            activation_checkpointing=ac and self.trainable, seed=seed, hf_config=self.hf_config,
        )
        if self.lora is not None:
            from megarl.backends.torch.lora import apply_actor_lora

            apply_actor_lora(model, self.lora, self.layout, seed)
        with torch.device("meta"):
            full = Transformer(self.args, head=self.head, num_labels=self.num_labels or 2,
                               dtype=self.param_dtype)
        self.pp_stage = self.mesh["pp"].get_local_rank()
        layer_stage = {
            i: s for s in range(lay.pp)
            for i in par.stage_layers(self.args.num_hidden_layers, s, lay.pp)
        }
        self._specs = weight_specs(full, layer_stage, lay.pp, self.param_dtype)
        self._adapter_specs = []
        if self.lora is not None:
            lo = self.lora
            apply_lora(full, lo.rank, lo.alpha, lo.target_modules, lo.exclude_modules)
            self._adapter_specs = adapter_specs(full, layer_stage, lay.pp, self.param_dtype)
        par.split_stage(model, self.pp_stage, lay.pp)
        model.to(self.device)
        if lay.tp > 1:
            par.apply_tp(model, self.mesh["tp"], lay.sp, is_last=self.is_last_stage)
        mixed = self.param_dtype != self.compute_dtype
        if lay.dp_shard * lay.ulysses > 1 or mixed:
            par.apply_fsdp(
                model, fsdp_mesh(self.mesh, lay),
                param_dtype=self.compute_dtype if mixed else None,
                reshard_after_forward=lay.pp == 1,
                # the ranks of a sequence-parallel group hold parts of one micro-batch's
                # gradient: sum over them, average over data parallel
                gradient_divide_factor=lay.dp_shard if lay.ulysses > 1 else None,
            )
        # adapted weight name -> its LoRALinear (this stage's), folded in by export_weights
        self._merge = {f"{n}.weight": m for n, m in lora_modules(model).items()}
        self._runner = None
        if lay.pp > 1:
            self._runner = StageRunner(
                model, stage=self.pp_stage, num_stages=lay.pp, pp_group=self.pp_group,
                device=self.device, hidden_size=self.args.hidden_size,
                act_dtype=self.compute_dtype,
                out_width=self.args.hidden_size if self.head == "lm" else self.num_labels,
                out_kind=self._out_kind,
            )
        return model

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """Inside: the model computes without its LoRA adapters (the base model; a no-op
        without LoRA)."""
        with adapters_disabled(self.model):
            yield

    # ------------------------------------------------------------------ layout

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp_shard"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.layout.dp_shard

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["tp"].get_group() if self.layout.tp > 1 else None

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp_shard"].get_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def is_last_stage(self) -> bool:
        return self.mesh["pp"].get_local_rank() == self.layout.pp - 1

    @property
    def _out_kind(self) -> str:
        return "hidden" if self.head == "lm" else "logits"

    @property
    def _multiple(self) -> int:
        return math.lcm(self.layout.tp if self.layout.sp else 1, self.layout.ulysses)

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """The Ulysses sequence-parallel group (None without Ulysses)."""
        return self._shard.group if self._shard is not None else None

    def _seq_shard(self) -> SeqShard | None:
        U = self.layout.ulysses
        if U == 1:
            return None
        heads = self.args.num_attention_heads
        if heads % U:
            raise UserInputError(
                f"parallel.ulysses_sequence_parallel_size={U} must divide the model's "
                f"num_attention_heads ({heads}): each rank attends with heads / {U} heads; use "
                f"a divisor of {heads}"
            )
        m = self.mesh["ulysses"]
        return SeqShard(group=m.get_group(), rank=m.get_local_rank(), size=U)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ no-grad protocol

    def logprobs(
        self,
        batch: SequenceBatch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        micro_batches: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No-grad (logprob [B, L], entropy [B, L] or None), float32, 0 outside the response.

        micro_batches: optional flat list of row-index lists (a partition of 0..B-1); entry k is
        computed by DP rank ``k % dp_size`` as one packed micro-batch. Give the rows of a
        ``train_step`` micro-batch to get bit-identical logprobs (see `interleave_rank_splits`).
        """
        if self.role not in LM_ROLES:
            raise TypeError(f"logprobs needs an LM head; this backend's role is {self.role!r}")

        def collect(out: torch.Tensor, p: Packed) -> torch.Tensor:
            heads = self._head_outputs(out, p, temperature)
            return torch.stack([heads.logprob, heads.entropy], -1)

        res = self._forward_no_grad(batch, collect, 2, micro_batches)
        return res[..., 0], (res[..., 1] if with_entropy else None)

    def values(
        self, batch: SequenceBatch, micro_batches: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """Critic: no-grad values [B, L] float32 (value of token j read at column P + j - 1)."""
        if self.role != "critic":
            raise TypeError(f"values needs the critic role; this backend's role is {self.role!r}")
        res = self._forward_no_grad(
            batch, lambda o, p: self._head_outputs(o, p, 1.0).values[..., None], 1,
            micro_batches,
        )
        return res[..., 0]

    def token_scores(
        self, batch: SequenceBatch, micro_batches: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """PRM: no-grad logits [B, L, num_labels] float32 at each response token's column."""
        if self.role != "prm":
            raise TypeError(f"token_scores needs the prm role; this backend's role is {self.role!r}")
        def collect(out: torch.Tensor, p: Packed) -> torch.Tensor:
            if self._shard is not None:
                return sum_over_group(token_scores(out, self._shard.local(p)), self.sp_group)
            return token_scores(out, p)

        return self._forward_no_grad(batch, collect, self.num_labels, micro_batches)

    # ------------------------------------------------------------------ training

    def train_step(
        self, micro_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0
    ) -> dict[str, float]:
        """`forward_backward` then one clipped AdamW update (skipped on a non-finite grad
        norm); returns the loss metrics plus ``grad_norm``, ``lr`` and ``skipped``."""
        metrics = self.forward_backward(micro_batches, loss_fn, temperature)
        metrics.update(self._optimizer_step())
        return metrics

    def forward_backward(
        self, micro_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0
    ) -> dict[str, float]:
        """Accumulate the gradients of every micro-batch (summed over micro-batches, averaged
        over DP ranks) without an optimizer step; returns ``loss`` and the loss function's
        metrics (summed over micro-batches, averaged over DP: `reduce_metrics`). Every DP rank
        must pass the same number of micro-batches. Under pipeline parallelism with FSDP,
        torch's schedule clears gradients when it sets up a step, so calls do not accumulate
        there."""
        if self.optimizer is None:
            raise TypeError(f"the {self.role} backend is frozen (no optimizer)")
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        self.model.train()
        mbs = [mb.to(self.device) for mb in micro_batches]
        sums: dict[str, float] = {}
        if self._runner is None:
            for mb in mbs:
                p = pack(mb, self.device, multiple=self._multiple)
                out = self._run(p, replay_routing(self, mb, p))
                loss = self._loss(out, p, mb, loss_fn, temperature, sums)
                loss.backward()
        else:
            self._train_pipeline(mbs, loss_fn, temperature, sums)
        return reduce_metrics(sums, self.dp_group, self.pp_group)

    def _loss(self, out, p: Packed, mb: SequenceBatch, loss_fn: LossFn, temperature: float,
              sums: dict[str, float]) -> torch.Tensor:
        loss, metrics = loss_fn(self._head_outputs(out, p, temperature), mb)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("loss_fn must return (scalar loss tensor, metrics dict)")
        if not loss.requires_grad:  # keep every rank's backward (and its collectives) running
            loss = loss + out.sum() * 0.0
        sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
        for k, v in (metrics or {}).items():
            sums[k] = sums.get(k, 0.0) + float(v)
        return loss

    def _train_pipeline(self, mbs: list[SequenceBatch], loss_fn: LossFn, temperature: float,
                        sums: dict[str, float]) -> None:
        real = len(mbs)
        while len(mbs) < self.layout.pp:  # 1F1B needs at least one micro-batch per stage
            mbs = mbs + [empty_batch(mbs[0])]
        T = common_length([packed_length(mb) for mb in mbs], self._multiple)
        packed = [pack(mb, self.device, multiple=self._multiple, pad_to=T) for mb in mbs]

        def loss_for(out: torch.Tensor, i: int) -> torch.Tensor:
            if i >= real:
                return out.sum() * 0.0
            return self._loss(out, packed[i], mbs[i], loss_fn, temperature, sums)

        self._runner.train(packed, loss_for, pipeline_routing(self, mbs, packed))

    @torch.no_grad()
    def _optimizer_step(self) -> dict[str, float]:
        params = self._params()
        align_grad_placements(params)
        norm = float(total_grad_norm(params, self.pp_group if self.layout.pp > 1 else None))
        lr = self.optim.lr_at(self.step)
        skipped = not math.isfinite(norm)
        if skipped:
            logger.warning("%s: non-finite grad norm %s, skipping the update", self.role, norm)
        else:
            if self.optim.grad_clip:
                clip_grads_(params, float(self.optim.grad_clip), torch.tensor(norm))
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "lr": lr, "skipped": float(skipped)}

    # ------------------------------------------------------------------ weights / checkpoints

    def logprob_stats(self, batch: SequenceBatch, temperature: float = 1.0
                      ) -> dict[str, torch.Tensor]:
        """`megarl.backends.torch.heads.logprob_stats_of` (the Backend protocol's)."""
        from megarl.backends.torch.heads import logprob_stats_of

        return logprob_stats_of(self, batch, temperature)

    def recording_routing(self, batch: SequenceBatch) -> contextlib.AbstractContextManager:
        """`megarl.backends.torch.moe.recording_routing` (the Backend protocol's)."""
        from megarl.backends.torch.moe import recording_routing

        return recording_routing(self, batch)

    def routing_metrics(self, batch: SequenceBatch, rollout_logprob: torch.Tensor | None = None,
                        temperature: float = 1.0) -> dict[str, float]:
        """`megarl.backends.torch.moe.routing_metrics` of ``batch`` plus, with routing replay
        and ``rollout_logprob``, `replay_metrics`; {} for a dense model or under pipeline
        parallelism (a stage sees only its own layers)."""
        from megarl.backends.torch import moe

        if not self.args.is_moe or self.layout.pp > 1:
            return {}
        out = moe.routing_metrics(self, batch)
        if rollout_logprob is not None:
            out.update(moe.replay_metrics(self, batch, rollout_logprob, temperature))
        return out

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in HF order and the parameters' dtype (`param_dtype`); tied
        ``lm_head.weight`` omitted as HF does. Collective."""
        self._reshard()
        yield from iter_full_weights(
            self.model, self._specs, stage=self.pp_stage,
            pp_group=self.pp_group if self.layout.pp > 1 else None, device=self.device,
            merge=self._merge,
        )

    def export_adapter(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: (``<module>.lora_{A,B}.weight``, full tensor) of every adapter (A [r, in],
        B [out, r]), for `megarl.models.lora.save_peft_adapter`; nothing without LoRA.
        Collective."""
        self._reshard()
        yield from iter_full_weights(
            self.model, self._adapter_specs, stage=self.pp_stage,
            pp_group=self.pp_group if self.layout.pp > 1 else None, device=self.device,
        )

    def adapted_modules(self) -> list[str]:
        """LoRA: the full names of the adapted modules (module order); [] without LoRA."""
        return list(dict.fromkeys(s.name.rsplit(".lora_", 1)[0] for s in self._adapter_specs))

    def hf_export_config(self) -> dict[str, Any]:
        """config.json dict matching `export_weights` (architecture / labels of this role), for
        ``megarl.models.save_hf_checkpoint(dir, backend.export_weights(), backend.hf_export_config())``."""
        return hf_config_for(self.model)

    def full_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full gradient) like `export_weights` (zeros where a parameter has no
        gradient); for checks after `forward_backward`. Collective."""
        yield from iter_full_weights(
            self.model, self._specs, stage=self.pp_stage,
            pp_group=self.pp_group if self.layout.pp > 1 else None, device=self.device,
            grads=True,
        )

    def save(self, directory: str) -> None:
        """Collective: model (+ optimizer, step) via DCP; loadable at any other layout. With
        LoRA only the adapters and their optimizer state (the base is ``model_path``)."""
        ckpt.save_backend(self, directory)

    def load(self, directory: str) -> None:
        """Collective: inverse of `save` (at this backend's layout)."""
        ckpt.load_backend(self, directory)

    # ------------------------------------------------------------------ internals

    def _reshard(self) -> None:
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _run(self, p: Packed, routing: torch.Tensor | None = None) -> torch.Tensor:
        """The model's output of ``p`` ([1, T, ...]; this rank's token shard under Ulysses);
        ``routing``: replayed experts (`moe.replay_routing`)."""
        if self._shard is not None:
            return self.model(**self._shard.model_inputs(p), output=self._out_kind,
                              routing=routing)
        return self.model(
            p.input_ids, position_ids=p.position_ids, segment_ids=p.segment_ids,
            output=self._out_kind, routing=routing,
        )

    def _lm_weight(self) -> torch.Tensor:
        w = self.model.lm_head.weight
        return w.to_local() if isinstance(w, DTensor) else w

    def _head_outputs(self, out: torch.Tensor, p: Packed, temperature: float) -> TorchHeadOutputs:
        """Under Ulysses ``out`` is this rank's token shard: the heads read the shard's entries
        and sum the pieces over the group (full [b, L] tensors on every rank)."""
        sp = {}
        if self._shard is not None:
            p, sp = self._shard.local(p), {"sp_group": self.sp_group}
        if self.head == "lm":
            return lm_outputs(out, p, self._lm_weight(), temperature=temperature,
                              tp_group=self.tp_group, **sp, **self.kernel)
        return value_outputs(out, p, tp_group=self.tp_group, **sp)

    def _forward_no_grad(
        self,
        batch: SequenceBatch,
        collect: Callable[[torch.Tensor, Packed], torch.Tensor],
        width: int,
        micro_batches: Sequence[Sequence[int]] | None,
    ) -> torch.Tensor:
        """[B, L, width] float32 for the full batch on every rank (`no_grad.forward_no_grad`)."""
        return forward_no_grad(self, batch, collect, width, micro_batches)
