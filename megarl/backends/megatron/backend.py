"""MegatronBackend: one role (actor / ref / critic / prm) on megatron-core.

Gradient accumulation and scaling in `train_step` (the protocol wants the SUM over micro-batches
and the AVERAGE over data-parallel ranks of the gradients of the already normalised losses):

- megatron's schedules divide every micro-batch loss by ``num_microbatches`` before backward;
  the loss handed to them is ``loss * num_microbatches``, so the accumulated gradient is the sum
  (the factor only scales the scalar's gradient: exact for powers of two, otherwise within one
  float32 rounding of the gradient seed);
- megatron's DDP scales gradients by ``1 / dp_size`` before its all-reduce / reduce-scatter
  (``calculate_per_token_loss=False``, ``average_in_collective=False``): the DP average.
  Under context parallelism the schedule also multiplies each loss by CP and DDP divides by
  DP x CP; each CP rank's gradient is its tokens' part of the whole micro-batch's, so the sum
  over CP, averaged over DP, is again the protocol's gradient (`context_parallel`).
Metrics follow the same rule: summed over micro-batches, averaged over DP ranks over the union
of the ranks' keys (`megarl.backends.metrics.reduce_metrics`, shared with the torch backend).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megarl.backends.megatron import checkpoint, context_parallel, cpu_compat, moe, parallel, replay
from megarl.backends.megatron import lora as lora_lib
from megarl.backends.megatron.batching import MicroBatch, pad_to, to_micro_batch
from megarl.backends.megatron.config import (
    apply_transformer_overrides,
    backend_kwargs,
    recompute_settings,
)
from megarl.backends.megatron.dist_init import load_dist_checkpoint
from megarl.backends.megatron.heads import MegatronHeadOutputs, lm_outputs, value_outputs
from megarl.backends.megatron.model import (
    Layout,
    MegarlGPTModel,
    build_model_chunks,
    check_supported,
    te_available,
    transformer_config,
)
from megarl.backends.megatron.no_grad import forward_no_grad
from megarl.backends.megatron.optim import OptimSettings, build_optimizer, optimizer_step
from megarl.backends.megatron.weights import export_hf, load_hf_into_chunks
from megarl.backends.metrics import reduce_metrics
from megarl.backends.protocol import (
    LM_ROLES,
    ROLES,
    TRAINABLE_ROLES,
    VALUE_ROLES,
    LossFn,
    SequenceBatch,
)
from megarl.backends.routing import check_router_replay, replay_mode
from megarl.backends.settings import RoleSettings
from megarl.models.args import ModelArgs, num_labels_from_hf_config
from megarl.models.hf_io import read_hf_config
from megarl.models.lora import LoraSettings
from megarl.models.overrides import override_key
from megarl.utils.dtypes import canonical_dtype, torch_dtype

logger = logging.getLogger(__name__)


class MegatronBackend:
    """A `megarl.backends.protocol.Backend` on megatron-core (see module docstring).

    role:        actor | ref | critic | prm
    model_path:  HF folder (config.json + safetensors); critic may start from an LM checkpoint
                 (fresh ``score`` head), a PRM needs a token-classification checkpoint.
    tp, pp, vpp, sp: tensor / pipeline / virtual-pipeline sizes, sequence parallelism. All roles
                 of one process share tp and pp (megatron's parallel_state is global).
    ep, etp:     expert-parallel size and expert-tensor-parallel size (default tp) of a
                 mixture-of-experts model (`megarl.backends.megatron.moe`); shared by all roles
                 of one process like tp and pp.
    cp:          context-parallel size (`megarl.backends.megatron.context_parallel`): cp ranks
                 split each micro-batch's sequence; data parallel = world / (tp x pp x cp).
                 Shared by all roles of one process like tp and pp.
    dtype:       "fp32" or "bf16" (bf16 params via Float16Module, fp32 main params and grads).
    optim: `OptimSettings` (the shape both backends take), a mapping or a config object with
                 its fields (lr, betas, eps, weight_decay, grad_clip, lr_warmup_steps,
                 lr_warmup_steps_ratio, lr_scheduler_type, min_lr_ratio,
                 total_training_steps).
    recompute:   None | "full" | "selective" | {granularity, method, num_layers, modules}.
    use_fused_kernels: logprob/entropy through ``megarl_kernels.linear_logprob_entropy`` (else
                 the PyTorch fallback built on megatron's vocab_parallel_cross_entropy).
    spec:        "auto" (TransformerEngine when it imports on CUDA, else local) | "local" | "te".
    train:       build DDP + optimizer (default: actor and critic).
    forward_micro_batch_size: rows per no-grad forward (None: the DP share in ``pp`` pieces).
    num_labels:  PRM label count (default: the HF config's, else 2).
    hf_config:   with ``model_path=None``: build from this config.json dict without loading
                 weights (they are uninitialised until `load`; see `from_checkpoint`).
    moe_aux_loss_coeff: weight of megatron's load-balancing loss of an MoE model, added to the
                 training loss (see `megarl.backends.megatron.moe.aux_loss_metric` for its
                 definition: per layer and micro-batch over the real tokens, summed over
                 layers, averaged over micro-batches and DP ranks); ``train_step`` reports it
                 (without the coefficient) as ``moe_aux_loss``. 0: off.
    router_replay: MoE routing replay (actor / ref): forwards route each token to the experts
                 in the batch's ``routed_experts`` (recorded by the rollout engine) instead of
                 the routers' top-k (`megarl.backends.megatron.replay`); batches without it
                 route as usual.
    lora:        actor only: LoRA adapters on the loaded model (`megarl.backends.megatron.lora`:
                 TP/PP-aware, PEFT's names); the base is frozen, the optimizer and checkpoints
                 hold the adapters only, the reference is `lora.AdapterOffReference`. Uses
                 megatron's local layer spec.
    """

    def __init__(
        self,
        role: str,
        model_path: str | None,
        *,
        tp: int = 1,
        pp: int = 1,
        vpp: int | None = None,
        sp: bool = False,
        ep: int = 1,
        etp: int | None = None,
        cp: int = 1,
        dtype: str = "fp32",
        optim: OptimSettings | Mapping[str, Any] | Any | None = None,
        use_distributed_optimizer: bool = True,
        recompute: str | Mapping[str, Any] | None = None,
        seed: int = 1,
        use_fused_kernels: bool = True,
        spec: str = "auto",
        train: bool | None = None,
        forward_micro_batch_size: int | None = None,
        num_labels: int | None = None,
        hf_config: dict[str, Any] | None = None,
        moe_aux_loss_coeff: float = 0.0,
        router_replay: bool | str = False,
        lora: LoraSettings | None = None,
        hf_overrides: Mapping[str, Any] | None = None,
        transformer_overrides: Mapping[str, Any] | None = None,
        dist_checkpoint: str | None = None,
        dist_checkpoint_prefix: str = "",
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        dtype = canonical_dtype(dtype)
        if spec not in ("auto", "local", "te"):
            raise ValueError(f"spec must be 'auto', 'local' or 'te', got {spec!r}")
        self.role = role
        if model_path is None and hf_config is None:
            raise ValueError("MegatronBackend needs model_path (an HF folder) or hf_config")
        self.model_path = None if model_path is None else str(model_path)
        self.hf_config = dict(hf_config) if model_path is None else read_hf_config(
            model_path, hf_overrides, key=override_key(role))
        self.args = ModelArgs.from_hf_config(self.hf_config)
        self.layout = Layout(tp=tp, pp=pp, vpp=vpp, sp=sp, ep=ep, etp=etp, cp=cp)
        check_supported(self.args, self.layout)
        self.dtype = torch_dtype(dtype)
        self.dtype_name = dtype
        self.num_labels = None
        if role == "critic":
            self.num_labels = 1
        elif role == "prm":
            self.num_labels = num_labels or num_labels_from_hf_config(self.hf_config)
        self.trainable = role in TRAINABLE_ROLES if train is None else bool(train)
        self.optim = OptimSettings.coerce(optim)
        self.use_fused_kernels = use_fused_kernels
        self.forward_micro_batch_size = forward_micro_batch_size
        self.seed = seed
        self.step = 0  # optimizer updates applied (the LR schedule position)
        if lora is not None and role != "actor":
            raise ValueError(f"LoRA adapters train on the actor only, not on the {role}")
        self.lora = lora
        self.lora_specs: list[lora_lib.AdapterSpec] = []

        dense_any = not self.args.is_moe and ep == 1 and etp is None  # EP groups unused
        parallel.ensure_model_parallel(
            tp, pp, seed, ep=None if dense_any else ep, etp=None if dense_any else etp, cp=cp
        )
        self.use_te = spec == "te" or (spec == "auto" and te_available() and lora is None)
        if lora is not None and self.use_te:
            raise ValueError("LoRA on the megatron backend uses megatron's local layer spec: "
                             "spec='auto' or 'local'")
        if spec == "te" and not te_available():
            raise RuntimeError("spec='te' needs TransformerEngine and CUDA; use spec='local'")
        self.moe_aux_loss_coeff = float(moe_aux_loss_coeff) if self.args.is_moe else 0.0
        self.config = transformer_config(
            self.args, self.layout, dtype=self.dtype, recompute=recompute_settings(recompute),
            moe_aux_loss_coeff=self.moe_aux_loss_coeff,
        )
        self.config = apply_transformer_overrides(self.config, transformer_overrides, role)
        with cpu_compat.cuda_to_cpu(), parallel.virtual_pp(vpp):
            self.chunks = build_model_chunks(
                role,
                self.args,
                self.config,
                self.layout,
                pp_rank=parallel.pp_rank(),
                num_labels=self.num_labels,
                use_te=self.use_te,
            )
            if dist_checkpoint is not None:
                load_dist_checkpoint(self.chunks, dist_checkpoint, prefix=dist_checkpoint_prefix,
                                     value_model=role in VALUE_ROLES, role=role)
            elif model_path is not None:
                load_hf_into_chunks(
                    self.chunks, model_path, self.args, role, self.num_labels, seed
                )
            if lora is not None:
                self.lora_specs = lora_lib.install(self.chunks, self.args, self.layout, lora, seed)
            self.modules: list[torch.nn.Module] = [
                Float16Module(self.config, c) if self.dtype == torch.bfloat16 else c
                for c in self.chunks
            ]
            self.router_replay_mode = replay_mode(router_replay)
            self.router_replay = self.router_replay_mode != "disabled"
            self._replays = []
            if self.router_replay:
                check_router_replay(self.args, role, self.router_replay_mode)
                if cp > 1:
                    raise ValueError("MoE routing replay reads each token's recorded experts "
                                     "by column and is not wired for context parallelism: use "
                                     "context_parallel_size=1 with router_replay")
                self._replays = replay.install(self.chunks, self.args)
            self._measure_replay = False  # set by replay.replay_metrics
            self.optimizer = None
            if self.trainable:
                self._wrap_for_training(use_distributed_optimizer)
            else:
                for m in self.modules:
                    m.requires_grad_(False)
                    m.eval()

    @classmethod
    def from_checkpoint(cls, directory: str, **kwargs: Any) -> MegatronBackend:
        """A backend rebuilt from a checkpoint of `save` alone (role, HF config, label count and
        dtype from its ``megarl_meta.json``; a LoRA checkpoint's base from its source folder);
        ``kwargs`` (tp, pp, ..., ``train``, ``dtype``, ``role``) override. Frozen
        (``train=False``) unless asked otherwise."""
        meta = checkpoint.read_meta(directory)
        role = kwargs.pop("role", meta["role"])
        kwargs.setdefault("dtype", meta.get("dtype", "fp32"))
        kwargs.setdefault("train", False)
        if role == "prm":
            kwargs.setdefault("num_labels", meta.get("num_labels"))
        if meta.get("lora") is not None:  # adapters only: the base is the source folder
            kwargs.setdefault("lora", LoraSettings(**meta["lora"]))
            backend = cls(role, meta["source"], **kwargs)
        else:
            backend = cls(role, None, hf_config=meta["hf_config"], **kwargs)
        backend.load(directory)
        return backend

    @classmethod
    def from_settings(cls, settings: RoleSettings) -> MegatronBackend:
        """Build ``settings.role`` (`megarl.trainer.settings.role_settings`; see
        `megarl.backends.megatron.config`)."""
        path, kwargs = backend_kwargs(settings)
        return cls(settings.role, path, **kwargs)

    # ------------------------------------------------------------------ construction helpers

    def _wrap_for_training(self, distributed: bool) -> None:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=distributed,
        )
        self.modules = [
            DistributedDataParallel(self.config, ddp_config, m, disable_bucketing=i > 0)
            for i, m in enumerate(self.modules)
        ]
        self.config.no_sync_func = (
            [m.no_sync for m in self.modules] if len(self.modules) > 1 else self.modules[0].no_sync
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = build_optimizer(
            self.modules,
            self.optim,
            bf16=self.dtype == torch.bfloat16,
            distributed=distributed,
        )

    # --------------------------------------------------------------------------- protocol

    @property
    def dp_rank(self) -> int:
        return ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return ps.get_data_parallel_world_size()

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return parallel.tp_group()

    def logprobs(
        self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.role not in LM_ROLES:
            raise TypeError(f"logprobs needs an LM head; this backend's role is {self.role!r}")

        def collect(outputs: MegatronHeadOutputs) -> torch.Tensor:
            lp = outputs.logprob
            return torch.stack([lp, outputs.entropy]) if with_entropy else lp[None]

        out = self._forward_no_grad(batch, collect, temperature, width=2 if with_entropy else 1)
        return out[0], (out[1] if with_entropy else None)

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        if self.role != "critic":
            raise TypeError(f"values needs the critic role; this backend's role is {self.role!r}")
        return self._forward_no_grad(batch, lambda o: o.values[None], 1.0, width=1)[0]

    def token_scores(self, batch: SequenceBatch) -> torch.Tensor:
        if self.role != "prm":
            raise TypeError(f"token_scores needs the prm role; this backend's role is {self.role!r}")
        out = self._forward_no_grad(
            batch, lambda o: o.scores.permute(2, 0, 1), 1.0, width=self.num_labels
        )
        return out.permute(1, 2, 0).contiguous()

    def train_step(
        self, micro_batches: list[SequenceBatch], loss_fn: LossFn, temperature: float = 1.0
    ) -> dict[str, float]:
        if not self.trainable:
            raise TypeError(f"the {self.role} backend was built without an optimizer (train=False)")
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        M = len(micro_batches)
        if self.layout.vpp and M % self.layout.pp:
            raise ValueError(
                f"interleaved pipeline (virtual_pipeline_model_parallel_size={self.layout.vpp}) "
                f"needs a multiple of pipeline_model_parallel_size={self.layout.pp} "
                f"micro-batches, got {M}"
            )
        mbs = [self._prepare(mb) for mb in micro_batches]

        def loss_func(mb: MicroBatch, hidden: torch.Tensor):
            outputs = self._head_outputs(hidden, mb, temperature)
            loss, metrics = loss_fn(outputs, mb.source)
            reported = {"loss": loss.detach().clone().float()}
            for k, v in (metrics or {}).items():
                reported[k] = torch.as_tensor(v, dtype=torch.float64).detach().clone()
            return loss * M, reported

        for m in self.modules:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe_aux_loss_coeff > 0:
            moe.reset_aux_tracker()
        stored = self._run_schedule(mbs, loss_func, forward_only=False)
        summed: dict[str, float] = {}  # over micro-batches (last stage)
        for d in stored:
            for k, v in d.items():
                summed[k] = summed.get(k, 0.0) + float(v)
        metrics = reduce_metrics(summed, parallel.dp_group(), parallel.pp_group())
        if self.moe_aux_loss_coeff > 0:  # every stage holds it: averaged over DP only
            aux = moe.aux_loss_metric(M, parallel.tp_cp_group(), parallel.pp_group())
            metrics.update(reduce_metrics({"moe_aux_loss": aux}, parallel.dp_group()))
        grad_norm, skipped, lr = optimizer_step(self.optimizer, self.optim, self.step)
        if not skipped:
            self.step += 1
        metrics.update(grad_norm=grad_norm, lr=lr, skipped=float(skipped))
        return metrics

    def logprob_stats(self, batch: SequenceBatch, temperature: float = 1.0
                      ) -> dict[str, torch.Tensor]:
        """`megarl.backends.megatron.heads.logprob_stats_of` (the Backend protocol's)."""
        from megarl.backends.megatron.heads import logprob_stats_of

        return logprob_stats_of(self, batch, temperature)

    def recording_routing(self, batch: SequenceBatch) -> contextlib.AbstractContextManager:
        """`megarl.backends.megatron.replay.recording_routing` (the Backend protocol's)."""
        return replay.recording_routing(self, batch)

    @torch.no_grad()
    def routing_metrics(self, batch: SequenceBatch, rollout_logprob: torch.Tensor | None = None,
                        temperature: float = 1.0) -> dict[str, float]:
        """With routing replay on and ``rollout_logprob``, what replay changes on ``batch``
        (`replay.replay_metrics`); {} otherwise. An MoE model's load-balancing loss is
        reported by every update (``moe_aux_loss``); per-expert load and router entropy are
        not measured on megatron."""
        if not self.router_replay or rollout_logprob is None:
            return {}
        return replay.replay_metrics(self, batch, rollout_logprob, temperature)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in HF order on every rank; with LoRA the adapters folded in
        (``W + (alpha / r) B A``). Collective."""
        stream = export_hf(self.chunks, self.args, self.layout, self.role, self.num_labels)
        if self.lora is None:
            yield from stream
            return
        adapter = dict(self.export_adapter())
        yield from lora_lib.merge_stream(stream, adapter, self.lora.scaling)

    def export_adapter(self, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: (``<module>.lora_{A,B}.weight``, full tensor) of every adapter (A [r, in],
        B [out, r]), for `megarl.models.lora.save_peft_adapter`; with ``grads`` the gradients
        the last train_step accumulated (fp32, as `export_grads`). Nothing without LoRA.
        Collective."""
        if self.lora is None:
            return
        if grads and self._grads_sharded():
            raise RuntimeError("export_adapter(grads=True) with the distributed optimizer needs "
                               "dp_size x context_parallel_size == 1 (each of those ranks "
                               "holds its shard of the reduced gradient only)")
        yield from lora_lib.gather_adapters(self.chunks, self.lora_specs, self.args,
                                            self.layout, self.lora.rank, grads=grads)

    def load_adapter(self, adapter: Mapping[str, torch.Tensor]) -> None:
        """LoRA: set the adapters from full tensors (`export_adapter`'s names, a PEFT file's
        without its ``base_model.model.`` prefix); every adapter must be given."""
        want = {f"{s.module}.lora_{ab}.weight" for s in self.lora_specs for ab in "AB"}
        if self.lora is None or set(adapter) != want:
            raise ValueError(f"load_adapter needs exactly this backend's {len(want)} adapter "
                             f"tensors; missing {sorted(want - set(adapter))[:4]}, unexpected "
                             f"{sorted(set(adapter) - want)[:4]}")
        lora_lib.set_adapters(self.chunks, dict(adapter), parallel.tp_rank(), self.layout.tp)
        if self.optimizer is not None:
            with cpu_compat.cuda_to_cpu():
                self.optimizer.reload_model_params()

    def adapted_modules(self) -> list[str]:
        """LoRA: the full HF names of the adapted modules; [] without LoRA."""
        return [s.module for s in self.lora_specs]

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """Inside: the model computes without its LoRA adapters (a no-op without LoRA)."""
        with lora_lib.adapters_disabled(self.chunks):
            yield

    @torch.no_grad()
    def export_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Debug / test aid: (HF name, full fp32 gradient) accumulated by the last train_step,
        as DDP reduced it and as the update applied it: with ``grad_clip`` active, already
        scaled by the clipping (the optimizer's fp32 main grads are views of these buffers and
        are clipped in place). Collective. Needs
        dp_size == 1 or the non-distributed optimizer (the distributed one reduce-scatters:
        each DP rank then holds only its shard of the reduced gradient)."""
        if self.optimizer is None:
            raise TypeError(f"the {self.role} backend has no gradients (train=False)")
        if self._grads_sharded():
            raise RuntimeError("export_grads with the distributed optimizer needs dp_size x "
                               "context_parallel_size == 1")
        yield from export_hf(
            self.chunks, self.args, self.layout, self.role, self.num_labels, grads=True
        )

    def logits(self, batch: SequenceBatch, temperature: float = 1.0) -> torch.Tensor:
        """No-grad full-vocabulary logits / temperature [B, L, V] (float32) predicting the
        response tokens (the hidden state at column P + j - 1), 0 where a token has no
        predecessor or is padding. Materialises [B, L, V]: for checks and conversion, not
        for training."""
        if self.role not in LM_ROLES:
            raise TypeError(f"logits needs an LM head; this backend's role is {self.role!r}")
        V = self.args.vocab_size

        def collect(outputs: MegatronHeadOutputs) -> torch.Tensor:
            z = (outputs.hidden @ outputs.weight.t()).float() / outputs.temperature
            if self.layout.tp > 1:
                parts = [torch.empty_like(z) for _ in range(self.layout.tp)]
                dist.all_gather(parts, z.contiguous(), group=self.tp_group)
                z = torch.cat(parts, dim=-1)
            full = z.new_zeros((*outputs.shape, V)).index_put(outputs.flat_index, z)
            return outputs.group_sum(full).permute(2, 0, 1)

        out = self._forward_no_grad(batch, collect, temperature, width=V)
        return out.permute(1, 2, 0).contiguous()

    def save(self, directory: str, include_optimizer: bool = True) -> None:
        """Collective: the model (+ optimizer, step) via megatron's dist checkpointing;
        loadable at another layout (`checkpoint.save_backend`)."""
        checkpoint.save_backend(self, directory, include_optimizer)

    def load(self, directory: str) -> None:
        """Collective: inverse of `save` (at this backend's layout)."""
        checkpoint.load_backend(self, directory)

    # ------------------------------------------------------------------------- internals

    def _prepare(self, batch: SequenceBatch) -> MicroBatch:
        return to_micro_batch(batch, parallel.device(), pad_multiple=self.layout.seq_multiple)

    def _grads_sharded(self) -> bool:
        """Whether each rank holds only a shard of the reduced gradients: the distributed
        optimizer over more than one data-parallel x context-parallel rank."""
        return (ps.get_data_parallel_world_size(with_context_parallel=True) > 1
                and self.modules[0].ddp_config.use_distributed_optimizer)

    @property
    def _cp_group(self) -> dist.ProcessGroup | None:
        return parallel.cp_group() if self.layout.cp > 1 else None

    def _head_outputs(
        self, hidden: torch.Tensor, mb: MicroBatch, temperature: float
    ) -> MegatronHeadOutputs:
        model: MegarlGPTModel = self.chunks[-1]
        if self.role in LM_ROLES:
            return lm_outputs(
                hidden,
                mb,
                model.lm_head_weight(),
                temperature=temperature,
                sequence_parallel=self.layout.sp,
                tp_group=self.tp_group,
                use_kernel=self.use_fused_kernels,
                cp_group=self._cp_group,
            )
        return value_outputs(
            hidden,
            mb,
            model.score,
            role=self.role,
            sequence_parallel=self.layout.sp,
            tp_group=self.tp_group,
            cp_group=self._cp_group,
        )

    def _forward_step(self, loss_func, data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        kwargs = {"fp32_output": False} if self.dtype == torch.bfloat16 else {}
        if self.moe_aux_loss_coeff > 0 and torch.is_grad_enabled():
            kwargs["padding_mask"] = moe.padding_mask(mb.lengths, *mb.input_ids.shape,
                                                      columns=mb.columns)
        if self.router_replay:
            seen = (id(mb), id(model))  # align_over_dp may repeat a micro-batch
            first = seen not in self._counted
            self._counted.add(seen)
            replay.arm(model, mb, tp=self.layout.tp, tp_rank=parallel.tp_rank(),
                       sequence_parallel=self.layout.sp, counting=self._measure_replay and first,
                       apply=not self._measure_replay)
        hidden = model(mb.input_ids, mb.position_ids, None, **kwargs)
        return hidden, functools.partial(loss_func, mb)

    def _run_schedule(self, mbs: list[MicroBatch], loss_func, *, forward_only: bool) -> list:
        """megatron's forward(-backward) schedule over ``mbs``; returns what ``loss_func``
        reported per micro-batch (last pipeline stage; empty elsewhere)."""
        fb = get_forward_backward_func(pp_size=self.layout.pp, vp_size=self.layout.vpp)
        seq_len = max(mb.seq_len for mb in mbs)
        rows = max(mb.input_ids.shape[0] for mb in mbs)
        if self._experts_cross_dp():
            mbs, seq_len, rows = moe.align_over_dp(
                mbs, seq_len, rows, forward_only, parallel.dp_group(), self.dp_rank
            )
        if self.layout.pp > 1 or self._experts_cross_dp():
            mbs = [pad_to(mb, seq_len, rows) for mb in mbs]
        if self.layout.cp > 1:  # megatron's schedule divides seq_len by CP itself
            mbs = [context_parallel.shard(mb, self.layout.cp, parallel.cp_rank()) for mb in mbs]
        iters = [iter(mbs) for _ in self.modules]
        self._counted: set[tuple[int, int]] = set()  # micro-batches whose routing flips were counted
        with cpu_compat.cuda_to_cpu(), parallel.virtual_pp(self.layout.vpp), \
                replay.disarmed_after(self._replays):
            return fb(
                forward_step_func=functools.partial(self._forward_step, loss_func),
                data_iterator=iters if len(iters) > 1 else iters[0],
                model=self.modules if len(self.modules) > 1 else self.modules[0],
                num_microbatches=len(mbs),
                seq_length=seq_len,
                micro_batch_size=rows,
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )

    def _experts_cross_dp(self) -> bool:
        """Whether the MoE token exchange spans data-parallel ranks (see `moe.align_over_dp`)."""
        return self.args.is_moe and self.dp_size > 1 and (
            self.layout.ep > 1 or self.layout.expert_tp != self.layout.tp
        )

    def _forward_no_grad(self, batch: SequenceBatch, collect, temperature: float, width: int):
        """[width, B, L] of ``collect(outputs)`` for the full batch on every rank
        (`no_grad.forward_no_grad`)."""
        return forward_no_grad(self, batch, collect, temperature, width)
