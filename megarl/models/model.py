"""One decoder (Llama 3.x / Qwen2 / Qwen3 / Mistral; Qwen3-MoE / Qwen2-MoE) in plain PyTorch.

Numerics follow transformers' modeling_llama / modeling_qwen2 / modeling_qwen3 op for op (RMSNorm
in fp32 then cast back, RoPE cos/sin in fp32 then cast to the activation dtype, rotate_half).
Parameter names equal the HF names, so an HF state dict loads without renaming:

    model.embed_tokens.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}   (+ q_norm, k_norm for Qwen3)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight           (dense layers)
    model.layers.{i}.mlp.gate.weight, mlp.experts.{j}.*       (sparse layers, see `moe`)
    model.layers.{i}.{input,post_attention}_layernorm.weight
    model.norm.weight
    lm_head.weight  (head="lm")  |  score.weight, score.bias  (head="token_cls")

Parallelism is applied from outside (FSDP2 / DTensor TP / pipelining): layers live in a ModuleDict
keyed "0".."L-1" so a pipeline stage can delete some and keep the others' names; a stage without
``embed_tokens`` takes hidden states as input, one without ``norm`` returns hidden states; head
counts are read from tensor shapes, so TP-sharded projections work unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megarl.models.args import ModelArgs
from megarl.models.moe import MoEBlock, check_routing, sparse_layers

Head = Literal["lm", "token_cls"]


class KVCache(Protocol):
    """Attention hook owned by the rollout engine (cache layout, slots and masks)."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [B, n_heads, T, hd], k/v [B, n_kv_heads, T, hd] (post-RoPE) -> [B, n_heads, T, hd]."""
        ...


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the normalisation in fp32, cast back to x.dtype
    before the weight multiply (as transformers)."""

    def __init__(self, dim: int, eps: float, *, dtype=None, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding (non-interleaved halves, "rotate_half" convention)
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], fp32 on CPU (llama3 scaling applied when configured).

    Always built on CPU in fp32 so it is identical whatever device/dtype the model lives on and
    immune to ``model.to(bfloat16)`` (it is not a buffer)."""
    dim = args.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    rs = args.rope_scaling
    if rs is None:
        return inv_freq
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, head_dim] computed in fp32 and cast to ``dtype`` (the activation dtype:
    fp32 cos/sin would silently promote bf16 q/k to fp32). inv_freq must be on position_ids'
    device."""
    freqs = position_ids[..., None].to(torch.float32) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd], cos/sin [B, T, hd] -> x rotated, same shape and dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


# ---------------------------------------------------------------------------------------------
# Masks and positions
# ---------------------------------------------------------------------------------------------


def build_attention_mask(
    attention_mask: torch.Tensor | None, segment_ids: torch.Tensor | None, seq_len: int
) -> torch.Tensor | None:
    """Boolean mask [B, 1, T, T] (True = may attend) or None for plain causal attention.

    allowed[b, i, j] = j <= i and key j is real (attention_mask 1) and segment_ids equal. Every
    query may also attend to itself, so fully masked (padding) rows stay finite: their outputs are
    garbage but never NaN, and no real token attends to them.
    """
    if attention_mask is None and segment_ids is None:
        return None
    ref = attention_mask if attention_mask is not None else segment_ids
    idx = torch.arange(seq_len, device=ref.device)
    allowed = (idx[None, :] <= idx[:, None])[None]  # [1, T, T]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
    allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=ref.device)[None]
    return allowed[:, None]


@dataclass(frozen=True)
class SegmentGrid:
    """Packed rows laid out for attention as a padded grid of segments ``[S, Lmax]``.

    The block-diagonal causal mask of `build_attention_mask` costs ``B x T x T`` per head; when
    every segment is one contiguous run of its row, the same attention is causal attention
    within each segment, ``S x Lmax x Lmax``: gather the tokens into the grid, run causal SDPA,
    scatter back. Grid slots past a segment's end repeat its first token; causality keeps them
    out of every real query, and their own outputs are dropped.

    gather:  [S * Lmax] flat index (row * T + column) of each grid slot.
    scatter: [B * T] grid slot of each flat position.
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    num_segments: int
    max_len: int

    @classmethod
    def build(cls, segment_ids: torch.Tensor) -> SegmentGrid | None:
        """The grid of ``segment_ids`` [B, T], or None when a segment id is split into several
        runs of a row (the dense mask is exact there) or the grid would cost more than it."""
        b, t = segment_ids.shape
        seg = segment_ids.reshape(-1)
        flat = torch.arange(b * t, device=seg.device)
        start = torch.ones_like(seg, dtype=torch.bool)
        start[1:] = seg[1:] != seg[:-1]
        start[::t] = True  # a row always starts a run
        starts = flat[start]  # [S] first flat index of each run
        n = int(starts.numel())
        keys = (flat[start] // t) * (int(seg.max()) - int(seg.min()) + 1) + seg[start] - seg.min()
        if int(torch.unique(keys).numel()) != n:
            return None
        run = start.long().cumsum(0) - 1  # [B * T] run of each position
        lengths = torch.diff(starts, append=torch.tensor([b * t], device=seg.device))
        lmax = int(lengths.max())
        if n * lmax * lmax > b * t * t:
            return None
        slot = torch.arange(lmax, device=seg.device)
        gather = torch.where(slot[None] < lengths[:, None], starts[:, None] + slot[None],
                             starts[:, None])
        scatter = run * lmax + (flat - starts[run])
        return cls(gather.reshape(-1), scatter, n, lmax)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
               ) -> torch.Tensor:
        """q [B, n_heads, T, hd], k/v [B, n_kv_heads, T, hd] -> [B, n_heads, T, hd]."""
        b, nh, t, hd = q.shape

        def to_grid(x: torch.Tensor) -> torch.Tensor:
            heads = x.shape[1]
            x = x.transpose(1, 2).reshape(b * t, heads, hd)[self.gather]
            return x.view(self.num_segments, self.max_len, heads, hd).transpose(1, 2)

        qg, kg, vg = to_grid(q), to_grid(k), to_grid(v)
        n_rep = nh // kg.shape[1]
        kg, vg = repeat_kv(kg, n_rep), repeat_kv(vg, n_rep)
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
        out = out.transpose(1, 2).reshape(-1, nh, hd)[self.scatter]
        return out.view(b, t, nh, hd).transpose(1, 2)


def attention_layout(
    attention_mask: torch.Tensor | None, segment_ids: torch.Tensor | None, seq_len: int
) -> torch.Tensor | SegmentGrid | None:
    """What the attention layers get: a `SegmentGrid` for packed rows of contiguous segments
    (no attention_mask), else `build_attention_mask`'s boolean mask (or None: causal)."""
    if segment_ids is not None and attention_mask is None:
        grid = SegmentGrid.build(segment_ids)
        if grid is not None:
            return grid
    return build_attention_mask(attention_mask, segment_ids, seq_len)


def default_position_ids(
    input_shape: tuple[int, int],
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position ids [B, T] when the caller gives none.

    segment_ids: position within each contiguous run of equal ids (packed rows).
    attention_mask: cumsum(mask) - 1 clamped at 0 (left padding starts real tokens at 0; HF/verl).
    neither: 0..T-1 in every row.
    """
    batch, seq_len = input_shape
    idx = torch.arange(seq_len, device=device)
    if segment_ids is not None:
        starts = torch.ones_like(segment_ids, dtype=torch.bool)
        starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
        start_idx = torch.where(starts, idx[None], torch.zeros_like(idx)[None]).cummax(dim=1).values
        return idx[None] - start_idx
    if attention_mask is not None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return idx[None].expand(batch, seq_len)


class AttentionLayout(Protocol):
    """How the layers attend, when not through a boolean mask: `SegmentGrid` (packed rows), or
    a backend's sequence-parallel attention (megarl.backends.torch.ulysses)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
               ) -> torch.Tensor:
        """q [B, n_heads, T, hd], k/v [B, n_kv_heads, T, hd] (post-RoPE) -> [B, n_heads, T, hd]."""
        ...


def attend(
    layout: torch.Tensor | AttentionLayout | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of q [B, n_heads, T, hd] over k/v [B, n_kv_heads, T, hd] -> [B, n_heads, T, hd].
    layout: None (causal), a bool mask [B, 1, T, T] (True = may attend), or an `AttentionLayout`."""
    if layout is not None and not isinstance(layout, torch.Tensor):
        return layout.attend(q, k, v, scale)
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=layout, is_causal=layout is None, scale=scale
    )


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, n_kv, T, hd] -> [B, n_kv * n_rep, T, hd], each kv head repeated n_rep times in place."""
    if n_rep == 1:
        return x
    b, n_kv, t, hd = x.shape
    return x[:, :, None].expand(b, n_kv, n_rep, t, hd).reshape(b, n_kv * n_rep, t, hd)


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """GQA self-attention with RoPE (and Qwen3 q/k RMSNorm over head_dim)."""

    def __init__(self, args: ModelArgs, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__()
        fk = {"dtype": dtype, "device": device}
        h, hd = args.hidden_size, args.head_dim
        self.layer_idx = layer_idx
        self.head_dim = hd
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(h, args.num_attention_heads * hd, bias=args.qkv_bias, **fk)
        self.k_proj = nn.Linear(h, args.num_key_value_heads * hd, bias=args.qkv_bias, **fk)
        self.v_proj = nn.Linear(h, args.num_key_value_heads * hd, bias=args.qkv_bias, **fk)
        self.o_proj = nn.Linear(args.num_attention_heads * hd, h, bias=args.o_bias, **fk)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.rms_norm_eps, **fk)
            self.k_norm = RMSNorm(hd, args.rms_norm_eps, **fk)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | AttentionLayout | None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. mask: see `attend`."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q, k, v)
        else:
            out = attend(mask, q, k, v, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs, *, dtype=None, device=None) -> None:
        super().__init__()
        fk = {"dtype": dtype, "device": device, "bias": args.mlp_bias}
        h, i = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(h, i, **fk)
        self.up_proj = nn.Linear(h, i, **fk)
        self.down_proj = nn.Linear(i, h, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Submodule order = HF order."""

    def __init__(self, args: ModelArgs, layer_idx: int, *, dtype=None, device=None) -> None:
        super().__init__()
        fk = {"dtype": dtype, "device": device}
        self.self_attn = Attention(args, layer_idx, **fk)
        self.mlp: MLP | MoEBlock = (
            MoEBlock(args, layer_idx, **fk) if args.is_moe_layer(layer_idx) else MLP(args, **fk)
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **fk)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **fk)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | AttentionLayout | None,
        kv_cache: KVCache | None = None,
        routing: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """routing: [B, T, k] replayed experts of a sparse layer (see `MoEBlock.forward`)."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)
        h_mlp = self.post_attention_layernorm(h)
        return h + (self.mlp(h_mlp, routing) if routing is not None else self.mlp(h_mlp))


class DecoderModel(nn.Module):
    """The ``model.`` prefix of HF names: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs, *, dtype=None, device=None) -> None:
        super().__init__()
        fk = {"dtype": dtype, "device": device}
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            args.vocab_size, args.hidden_size, **fk
        )
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(args, i, **fk) for i in range(args.num_hidden_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(args.hidden_size, args.rms_norm_eps, **fk)


class Transformer(nn.Module):
    """Decoder + head. ``head="lm"``: ``lm_head`` [V, H] (tied to ``model.embed_tokens`` when
    ``args.tie_word_embeddings``); ``head="token_cls"``: ``score`` Linear(H, num_labels) like HF
    ``*ForTokenClassification`` (PRM: 2 labels; critic/value head: 1 label, see `value_model`).

    The classification head applies no dropout (HF's does in train mode; RL critics run without).
    """

    def __init__(
        self,
        args: ModelArgs,
        head: Head = "lm",
        num_labels: int = 2,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if head not in ("lm", "token_cls"):
            raise ValueError(f"head must be 'lm' or 'token_cls', got {head!r}")
        if head == "token_cls" and (not isinstance(num_labels, int) or num_labels < 1):
            raise ValueError(
                f"num_labels must be a positive int for head='token_cls', got {num_labels!r}"
            )
        fk = {"dtype": dtype, "device": device}
        self.args = args
        self.head = head
        self.num_labels = num_labels if head == "token_cls" else None
        self.activation_checkpointing = activation_checkpointing
        self.model = DecoderModel(args, **fk)
        self.lm_head: nn.Linear | None = None
        self.score: nn.Linear | None = None
        if head == "lm":
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False, **fk)
        else:
            self.score = nn.Linear(
                args.hidden_size, num_labels, bias=args.token_classification_bias, **fk
            )
        # plain fp32 tensors per device, not buffers (see rope_inv_freq)
        self._inv_freq = {torch.device("cpu"): rope_inv_freq(args)}
        self.tie_weights()
        if self.model.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    @property
    def tied(self) -> bool:
        return self.head == "lm" and self.args.tie_word_embeddings

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very Parameter of ``model.embed_tokens`` when tied (call
        again after anything that replaces parameters, e.g. ``load_state_dict(assign=True)``)."""
        if self.tied and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """HF-style init: N(0, initializer_range) for Linear/Embedding weights, zero biases,
        ones for norms. Safe to call after ``to_empty()`` of a meta-device model (which unties
        shared parameters: they are re-tied here first)."""
        self.tie_weights()
        std = self.args.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def _rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        return self._inv_freq[device]

    def output_weight(self) -> torch.Tensor:
        """The head weight: ``lm_head.weight`` [V, H] (= the embedding when tied) or
        ``score.weight`` [num_labels, H]; logits = hidden @ weight.T (+ score bias)."""
        layer = self.lm_head if self.lm_head is not None else self.score
        if layer is None:
            raise RuntimeError("this Transformer (pipeline stage) has no output head")
        return layer.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        output: Literal["logits", "hidden"] = "logits",
        attention: AttentionLayout | None = None,
        routing: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the decoder.

        input_ids:      [B, T] int token ids (or [B, T, H] hidden states on a pipeline stage
                        without ``embed_tokens``).
        position_ids:   [B, T] RoPE positions; default: see `default_position_ids`. Required with
                        ``kv_cache``.
        attention_mask: [B, T] 1 = real token (left or right padding); ignored with kv_cache.
        segment_ids:    [B, T] packed rows: equal id = same sequence (block-diagonal causal mask);
                        padding may use id -1 or attention_mask 0. Ignored with kv_cache.
        kv_cache:       object with ``attend(layer_idx, q, k, v)``; it owns caching and masking.
        output:         "logits" -> [B, T, V] (lm) or [B, T, num_labels] (token_cls), in the model
                        dtype; "hidden" -> final-normed hidden states [B, T, H].
        attention:      a ready `AttentionLayout` for every layer instead of the one built from
                        attention_mask / segment_ids (a backend's sequence-parallel attention,
                        where input_ids are this rank's token shard); needs position_ids.
        routing:        [B, T, n_sparse, k] experts every token is sent to in each sparse layer
                        (routing replay; sparse layers as `megarl.models.moe.sparse_layers`, -1
                        rows routed by the router). An argument of each layer's call, so an
                        activation-checkpointing recompute replays the same experts.
        Values at padding positions are finite but meaningless.
        """
        if output not in ("logits", "hidden"):
            raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
        m = self.model
        h = m.embed_tokens(input_ids) if m.embed_tokens is not None else input_ids
        batch, seq_len = h.shape[:2]

        if kv_cache is not None or attention is not None:
            if position_ids is None:
                raise ValueError("position_ids are required with a kv_cache or an attention")
            mask = attention
        else:
            mask = attention_layout(attention_mask, segment_ids, seq_len)
        if position_ids is None:
            position_ids = default_position_ids(
                (batch, seq_len), h.device, attention_mask, segment_ids
            )
        cos, sin = rope_cos_sin(self._rope_inv_freq(h.device), position_ids.to(h.device), h.dtype)

        use_ckpt = (
            self.activation_checkpointing
            and kv_cache is None
            and self.training
            and torch.is_grad_enabled()
        )
        sparse = {}
        if routing is not None:
            check_routing(self.args, routing, (batch, seq_len))
            sparse = self._sparse_index
        for idx, layer in m.layers.items():
            r = routing[:, :, sparse[int(idx)]] if int(idx) in sparse else None
            if use_ckpt:
                h = checkpoint(layer, h, cos, sin, mask, None, r, use_reentrant=False)
            else:
                h = layer(h, cos, sin, mask, kv_cache, r)

        if m.norm is None:  # not the last pipeline stage
            return h
        h = m.norm(h)
        if output == "hidden":
            return h
        head = self.lm_head if self.lm_head is not None else self.score
        return head(h) if head is not None else h

    @property
    def _sparse_index(self) -> dict[int, int]:
        """{layer index: its position among the sparse layers} (routing's third dim)."""
        return {layer: j for j, layer in enumerate(sparse_layers(self.args))}

    def extra_repr(self) -> str:
        return f"head={self.head!r}, num_labels={self.num_labels}, tied={self.tied}"


def value_model(args: ModelArgs, **kwargs: Any) -> Transformer:
    """A critic / value model: token classification with one label (values = logits[..., 0])."""
    return Transformer(args, head="token_cls", num_labels=1, **kwargs)
