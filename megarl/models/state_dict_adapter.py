"""The one place that maps HF checkpoint names <-> `Transformer` parameter names.

Our parameter names are the HF names, so the mapping is the identity except for:

- tied embeddings: HF checkpoints with ``tie_word_embeddings`` omit ``lm_head.weight``; on load it
  is the embedding, on export it is dropped again;
- heads: an LM checkpoint loaded with ``head="token_cls"`` has ``lm_head.weight`` and no
  ``score.*`` (and the reverse); that is an error unless ``allow_new_head=True`` was asked for;
- a bare ``*Model`` checkpoint (keys without the ``model.`` prefix) gets the prefix;
- stale buffers some old checkpoints carry (``rotary_emb.inv_freq``) are ignored.

Any other missing or unexpected key, or a shape mismatch, raises `CheckpointMismatchError`
listing them all: weights are never silently left at random init.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping

import torch

from megarl.errors import UserInputError
from megarl.models.args import ModelArgs

logger = logging.getLogger(__name__)

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_HEAD_PREFIXES = ("lm_head.", "score.")

# Order of parameters inside one decoder layer, as transformers registers them (state_dict order);
# HF shards a checkpoint greedily in that order, so saving in it reproduces HF's shard assignment.
# A sparse layer's mlp (router, experts 0..E-1, shared expert) sits where a dense layer's mlp is.
_LAYER_ORDER = [
    f"{mod}.{p}"
    for mod in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "mlp.gate",
        "mlp.experts",
        "mlp.shared_expert.gate_proj",
        "mlp.shared_expert.up_proj",
        "mlp.shared_expert.down_proj",
        "mlp.shared_expert_gate",
        "input_layernorm",
        "post_attention_layernorm",
    )
    for p in ("weight", "bias")
]
_LAYER_RANK = {name: i for i, name in enumerate(_LAYER_ORDER)}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
_TOP_RANK = {
    "model.embed_tokens.weight": 0,
    "model.norm.weight": 2,
    "lm_head.weight": 3,
    "score.weight": 4,
    "score.bias": 5,
}


class CheckpointMismatchError(UserInputError):
    """Checkpoint tensors do not match the model: lists missing, unexpected and mis-shaped keys."""


def hf_sort_key(name: str) -> tuple:
    """Sort key that puts HF tensor names in transformers' state_dict (module) order:
    embeddings, layers 0..L-1 (q, k, v, o, q_norm, k_norm, gate, up, down or router, experts
    0..E-1 (gate, up, down each), shared expert, norms), final norm, head. Unknown names go
    last, alphabetically."""
    if name in _TOP_RANK:
        return (_TOP_RANK[name], 0, 0, 0, name)
    m = _LAYER_RE.match(name)
    if m is not None:
        layer, rest = int(m.group(1)), m.group(2)
        e = _EXPERT_RE.match(rest)
        if e is not None:
            sub = 3 * int(e.group(1)) + _EXPERT_PART[e.group(2)]
            return (1, layer, _LAYER_RANK["mlp.experts.weight"], sub, name)
        return (1, layer, _LAYER_RANK.get(rest, len(_LAYER_RANK)), 0, name)
    return (9, 0, 0, 0, name)


def to_hf(
    named_tensors: Iterable[tuple[str, torch.Tensor]], args: ModelArgs
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our (name, tensor) pairs -> HF checkpoint pairs: identical names, ``lm_head.weight``
    dropped when the embeddings are tied (as transformers saves them)."""
    for name, tensor in named_tensors:
        if name == LM_HEAD and args.tie_word_embeddings:
            continue
        yield name, tensor


def model_state_for_export(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, detached tensor) pairs of a `Transformer`, in HF state_dict order."""
    state = model.state_dict()
    for name in sorted(state, key=hf_sort_key):
        yield from to_hf([(name, state[name].detach())], model.args)


def from_hf(
    hf_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    model: torch.nn.Module,
    *,
    allow_new_head: bool = False,
) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors -> a state dict with exactly ``model``'s keys (for
    ``load_state_dict(strict=True)``).

    allow_new_head: accept a checkpoint whose head does not match ``model.head`` (e.g. a critic
    initialised from an LM checkpoint): the other head's tensors are dropped and the model's own
    head keys are left out of the result (the caller keeps their fresh init). Body tensors must
    still all be present.
    Raises CheckpointMismatchError listing missing / unexpected / mis-shaped keys.
    """
    items = hf_tensors.items() if isinstance(hf_tensors, Mapping) else hf_tensors
    tensors = {name: t for name, t in items if not _IGNORED.search(name)}
    if tensors and not any(k.startswith("model.") for k in tensors):
        tensors = {
            (k if k.startswith(_HEAD_PREFIXES) else f"model.{k}"): v for k, v in tensors.items()
        }

    expected = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    tied = model.tied
    if tied and LM_HEAD in tensors:
        lm, emb = tensors.pop(LM_HEAD), tensors.get(EMBED)
        if emb is not None and not torch.equal(lm, emb):
            logger.warning(
                "config ties word embeddings but the checkpoint's lm_head.weight differs from "
                "model.embed_tokens.weight; using the embedding (as transformers does)"
            )
    if tied and EMBED in tensors:
        tensors[LM_HEAD] = tensors[EMBED]

    new_head: list[str] = []
    if allow_new_head:
        own = {k for k in expected if k.startswith(_HEAD_PREFIXES)}
        for k in [k for k in tensors if k.startswith(_HEAD_PREFIXES) and k not in own]:
            del tensors[k]  # the other head's tensors
        if not own & tensors.keys():  # a partly present head stays an error below
            new_head = sorted(own)
            for k in new_head:
                expected.pop(k)

    missing = sorted(set(expected) - set(tensors), key=hf_sort_key)
    unexpected = sorted(set(tensors) - set(expected), key=hf_sort_key)
    bad_shape = [
        f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(expected) & set(tensors), key=hf_sort_key)
        if tuple(tensors[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or bad_shape:
        lines = [
            f"checkpoint does not match the {model.args.model_type} model (head={model.head!r}):"
        ]
        if missing:
            lines.append(f"  missing ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): {', '.join(unexpected)}")
        if bad_shape:
            lines.append(f"  shape mismatch ({len(bad_shape)}): {'; '.join(bad_shape)}")
        if any(k.startswith(_HEAD_PREFIXES) for k in missing + unexpected):
            lines.append(
                "  (the head differs: pass allow_new_head=True to start a fresh head on this "
                "body, or check head/num_labels)"
            )
        raise CheckpointMismatchError("\n".join(lines))
    if new_head:
        logger.warning("checkpoint has no %s; they keep a fresh initialisation", new_head)
    return tensors
