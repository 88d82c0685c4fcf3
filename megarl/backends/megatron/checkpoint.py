"""Backend checkpoints through ``megatron.core.dist_checkpointing`` (torch_dist format).

A checkpoint directory holds megatron's files (``.metadata``, ``__*.distcp``, ``common.pt``,
``metadata.json``) plus ``megarl_meta.json`` (role, HF config, layout it was written from,
step, whether optimizer state is inside). Tensors are stored under layout-independent keys
(global layer numbers, full tensor shapes), so a checkpoint written at one TP/PP/VPP/DP loads at
any other; the distributed optimizer's state is saved ``fully_reshardable`` for the same reason.
Keys are those of megatron's local spec, which TransformerEngine layers map onto.
"""

from __future__ import annotations

import os
import queue
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megarl.backends import checkpoint_meta
from megarl.backends.megatron import cpu_compat
from megarl.backends.megatron import lora as lora_lib
from megarl.backends.protocol import LM_ROLES

FORMAT = "megarl-megatron-v1"


def sharded_metadata() -> dict[str, Any]:
    return {
        "distrib_optim_sharding_type": "fully_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def in_process_results_queue() -> None:
    """Hand megatron's checkpoint writer a plain ``queue.Queue`` for its results.

    ``FileSystemWriterAsync`` collects what its writer processes wrote through a queue of a
    ``multiprocessing`` Manager that it spawns once per process: a fresh interpreter that
    imports torch (seconds of CPU per rank) and a server process that outlives a rank killed
    with SIGKILL. megarl's saves are synchronous (``dist_checkpointing.save`` runs the write in
    the calling process, which puts the results and reads them back), so an in-process queue
    carries them. Only megatron's unset default is replaced."""
    if getattr(filesystem_async, "_results_queue", ...) is None:
        filesystem_async._results_queue = queue.Queue()


def model_sharded_state(chunks: list[torch.nn.Module], metadata: dict[str, Any],
                        adapters_only: bool = False) -> dict:
    """The chunks' dist-checkpoint entries; ``adapters_only``: the LoRA adapters alone
    (``lora.*``, `megarl.backends.megatron.lora`)."""
    def state(chunk: torch.nn.Module) -> dict:
        out = chunk.sharded_state_dict(metadata=metadata)
        return {k: v for k, v in out.items() if _is_adapter(k)} if adapters_only else out

    if len(chunks) == 1:
        return {"model": state(chunks[0])}
    return {f"model{i}": state(c) for i, c in enumerate(chunks)}


def _is_adapter(key: str) -> bool:
    return key.startswith("lora.")


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    return checkpoint_meta.read_meta(
        directory, FORMAT, "megatron",
        how_to_write="MegatronBackend.save or `python -m conversion hf-to-megatron`")


def save(
    directory: str | os.PathLike,
    chunks: list[torch.nn.Module],
    optimizer,
    meta: dict[str, Any],
    adapters_only: bool = False,
) -> None:
    """Collective: write model (+ optimizer) state and ``meta`` (rank 0) to ``directory``;
    ``adapters_only``: of the model, the LoRA adapters alone."""
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if any(p.name != checkpoint_meta.META_NAME for p in directory.iterdir()):
            raise FileExistsError(f"checkpoint directory {directory} is not empty")
    dist.barrier()
    metadata = sharded_metadata()
    with cpu_compat.cuda_to_cpu(), cpu_compat.cuda_type_strings():
        state = model_sharded_state(chunks, metadata, adapters_only)
        if optimizer is not None:
            materialize_optimizer_state(optimizer)
            state["optimizer"] = optimizer.sharded_state_dict(
                state, is_loading=False, metadata=metadata
            )
        in_process_results_queue()
        dist_checkpointing.save(state, str(directory))
    if dist.get_rank() == 0:
        meta = {"format": FORMAT, **meta, "has_optimizer": optimizer is not None}
        checkpoint_meta.write_meta(directory, meta)
    dist.barrier()


def load(
    directory: str | os.PathLike, chunks: list[torch.nn.Module], optimizer,
    adapters_only: bool = False,
) -> dict[str, Any]:
    """Collective: load model (and, when the checkpoint has it and ``optimizer`` is given,
    optimizer) state into the wrapped chunks; returns the checkpoint's meta.
    ``adapters_only``: of the model, the LoRA adapters alone (the base stays as loaded)."""
    meta = read_meta(directory)
    with_optim = optimizer is not None and meta.get("has_optimizer", False)
    metadata = sharded_metadata()
    with cpu_compat.cuda_to_cpu(), cpu_compat.cuda_type_strings():
        state = model_sharded_state(chunks, metadata, adapters_only)
        if with_optim:
            materialize_optimizer_state(optimizer)
            state["optimizer"] = optimizer.sharded_state_dict(
                state, is_loading=True, metadata=metadata
            )
        loaded = dist_checkpointing.load(state, str(directory))
        keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
        for key, chunk in zip(keys, chunks):
            _load_model_state(chunk, loaded[key], adapters_only)
        if with_optim:
            _load_optimizer_state(optimizer, loaded["optimizer"])
        elif optimizer is not None:
            optimizer.reload_model_params()  # fp32 main params from the loaded weights
    return meta


def save_backend(backend: Any, directory: str, include_optimizer: bool = True
                 ) -> None:
    """`MegatronBackend.save`: ``backend``'s chunks (+ optimizer unless not
    ``include_optimizer``) with the role, HF config, layout, dtype, step, source folder and
    LoRA settings in the meta (with LoRA the adapters and their optimizer state only).
    Collective."""
    lay = backend.layout
    meta = {
        "role": backend.role,
        "hf_config": backend.hf_config,
        "num_labels": backend.num_labels,
        "tp": lay.tp,
        "pp": lay.pp,
        "vpp": lay.vpp,
        "ep": lay.ep,
        "etp": lay.expert_tp,
        "dtype": backend.dtype_name,
        "step": backend.step,
        "source": backend.model_path,
    }
    if backend.lora is not None:  # adapters (+ their optimizer state) only
        meta["lora"] = lora_lib.settings_json(backend.lora)
    optimizer = backend.optimizer if include_optimizer else None
    save(directory, backend.chunks, optimizer, meta, adapters_only=backend.lora is not None)


def load_backend(backend: Any, directory: str) -> None:
    """`MegatronBackend.load`: refuse a checkpoint of another role or other LoRA adapters,
    then load it into ``backend`` (and its step, when it has the optimizer's state and the
    backend trains). Collective."""
    meta = read_meta(directory)
    checkpoint_meta.check_role_and_adapters(directory, meta, backend.role,
                                            lora_lib.settings_json(backend.lora),
                                            meta.get("lora"))
    meta = load(directory, backend.chunks, backend.optimizer,
                adapters_only=backend.lora is not None)
    if meta.get("has_optimizer") and backend.optimizer is not None:
        backend.step = int(meta.get("step", 0))


@torch.no_grad()
def materialize_optimizer_state(optimizer) -> None:
    """Give a never-stepped distributed optimizer over torch's AdamW (no Apex / TE, i.e. CPU)
    its zero Adam state: megatron's state_dict needs a common ``step`` in it, both to save and
    to load into. A zero-gradient AdamW step with lr and weight decay 0 leaves the parameters
    unchanged; the step counter is then reset to 0 so a resumed run's bias correction is exact.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(sub, distrib_optimizer.DistributedOptimizer) or inner is None:
            continue
        if len(inner.state) > 0:
            continue
        saved = [(g["lr"], g["weight_decay"]) for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
            for p in g["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        inner.step()
        for g, (lr, wd) in zip(inner.param_groups, saved):
            g["lr"], g["weight_decay"] = lr, wd
            for p in g["params"]:
                p.grad = None
                if "step" in inner.state[p]:
                    inner.state[p]["step"].zero_()


def _load_optimizer_state(optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, working around megatron 0.16.1 with torch's AdamW
    (no Apex / TransformerEngine, i.e. on CPU): its DistributedOptimizer copies every key of the
    torch per-parameter state, ``step`` included, from the loaded parameter state, which has no
    ``step`` (KeyError). So the param state is loaded with ``step`` set aside, then restored,
    one tensor per parameter (megatron shares one, which AdamW would advance once per param).
    A mixture-of-experts model has a chain of two (dense and expert parameters)."""
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if len(subs) == 1:
        _load_sub_optimizer_state(subs[0], state)
        return
    # A chain (a mixture-of-experts model: dense and expert parameters apart): one state per
    # optimizer, keyed by its index.
    if len(state) != len(subs):
        raise RuntimeError(
            f"the checkpoint holds {len(state)} optimizer states, this model has {len(subs)} "
            "optimizers (dense / expert parameters)"
        )
    for sub, key in zip(subs, sorted(state)):
        _load_sub_optimizer_state(sub, state[key])


def _load_sub_optimizer_state(sub, state: dict[str, Any]) -> None:
    """One (not chained) optimizer's part of `_load_optimizer_state`."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(sub, DistributedOptimizer) or "param_state" not in state:
        sub.load_state_dict(state)
        return
    state = dict(state)
    param_state = state.pop("param_state")
    kind = state.pop("param_state_sharding_type")
    sub.load_state_dict(state)  # param groups, inner torch state (with the saved step)
    steps = {}
    for key, value in sub.optimizer.state.items():
        if "step" in value:
            steps[key] = value.pop("step")
    try:
        if kind != "fully_reshardable":
            raise ValueError(f"unexpected optimizer state format {kind!r}")
        sub.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for key, step in steps.items():
            # megatron puts ONE step tensor into every parameter's state; torch's AdamW then
            # increments it in place once per parameter. Give each parameter its own copy.
            sub.optimizer.state[key]["step"] = step.detach().clone()


def _load_model_state(chunk: torch.nn.Module, state: dict[str, Any],
                      adapters_only: bool = False) -> None:
    expected = [k for k in chunk.state_dict() if not k.endswith("_extra_state")
                and (_is_adapter(k) or not adapters_only)]
    missing = [k for k in expected if k not in state]
    if missing:
        raise KeyError(f"checkpoint lacks model tensors: {missing}")
    chunk.load_state_dict(state, strict=False)  # megatron's wrappers return None


def expected_model_tensors(args, role: str, num_labels: int | None) -> dict[str, tuple]:
    """{dist-checkpoint key: global shape} of the model tensors a checkpoint of ``role`` holds,
    whatever layout wrote it: layers stacked along a leading [num_layers] axis (MoE models: one
    key per layer, the experts of a layer stacked along a leading [num_experts] axis), pre-norms under
    TransformerEngine's names (megatron's local spec maps its keys onto them), a tied LM head
    stored once as the embedding."""
    h, hd, L = args.hidden_size, args.head_dim, args.num_hidden_layers
    q, kv, ffn = args.num_attention_heads * hd, args.num_key_value_heads * hd, args.intermediate_size
    layer = {
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": (q + 2 * kv, h),
        "self_attention.linear_proj.weight": (h, q),
        "mlp.linear_fc1.layer_norm_weight": (h,),
        "mlp.linear_fc1.weight": (2 * ffn, h),
        "mlp.linear_fc2.weight": (h, ffn),
    }
    if args.qkv_bias:
        layer["self_attention.linear_qkv.bias"] = (q + 2 * kv,)
    if args.qk_norm:
        layer["self_attention.q_layernorm.weight"] = (hd,)
        layer["self_attention.k_layernorm.weight"] = (hd,)
    if args.is_moe:
        # MoE models (megatron's moe_layer_freq list): one key per layer, experts stacked.
        out = {}
        for i in range(L):
            keys = dict(layer)
            if args.is_moe_layer(i):
                del keys["mlp.linear_fc1.weight"], keys["mlp.linear_fc2.weight"]
                keys.update(moe_model_tensors(args))
            out.update({f"decoder.layers.{i}.{k}": v for k, v in keys.items()})
    else:
        out = {f"decoder.layers.{k}": (L, *v) for k, v in layer.items()}
    out["embedding.word_embeddings.weight"] = (args.vocab_size, h)
    out["decoder.final_layernorm.weight"] = (h,)
    if role in LM_ROLES:
        if not args.tie_word_embeddings:
            out["output_layer.weight"] = (args.vocab_size, h)
    else:
        out["score.weight"] = (num_labels, h)
        if args.token_classification_bias:
            out["score.bias"] = (num_labels,)
    return out


def moe_model_tensors(args) -> dict[str, tuple]:
    """{key under ``decoder.layers.{i}.``: global shape} of one sparse layer's MLP."""
    h, E, inner = args.hidden_size, args.num_experts, args.moe_intermediate_size
    out = {
        "mlp.router.weight": (E, h),
        "mlp.experts.experts.linear_fc1.weight": (E, 2 * inner, h),
        "mlp.experts.experts.linear_fc2.weight": (E, h, inner),
    }
    shared = args.shared_expert_intermediate_size
    if shared:
        out["mlp.shared_experts.linear_fc1.weight"] = (2 * shared, h)
        out["mlp.shared_experts.linear_fc2.weight"] = (h, shared)
        out["mlp.shared_experts.gate_weight"] = (1, h)
    return out


def check_model_tensors(directory: str | os.PathLike, args, role: str, num_labels) -> int:
    """Compare the model tensors stored in ``directory`` with `expected_model_tensors`; raise
    ValueError naming every missing, unexpected or mis-shaped one. Returns their count."""
    with cpu_compat.cuda_to_cpu():
        stored = dist_checkpointing.load_tensors_metadata(str(directory))
    have = {
        k: tuple(v.global_shape) for k, v in stored.items() if not k.startswith("optimizer.")
    }
    want = expected_model_tensors(args, role, num_labels)
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    bad = [f"{k}: {have[k]} vs {want[k]}" for k in sorted(set(want) & set(have))
           if have[k] != want[k]]
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        if bad:
            parts.append(f"wrong shapes {bad}")
        raise ValueError(f"checkpoint {directory} is incomplete: " + "; ".join(parts))
    return len(have)
