"""Our Transformer against transformers' own Llama / Qwen2 / Qwen3 / Mistral classes.

Every folder is written by transformers (`make_tiny_hf_model`), loaded by transformers as the
reference and by `megarl.models.load_model` as the system under test.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megarl.models import load_model

ATOL = 1e-5

# (family, config overrides): GQA ratios 1, 2, 4; tied and untied; biases; q/k norm; llama3 rope
CASES = [
    ("llama", {"num_key_value_heads": 4}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}),
    ("llama3", {}),
    ("qwen2", {}),
    ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    ("qwen3", {}),
    ("qwen3", {"num_key_value_heads": 4, "tie_word_embeddings": True, "attention_bias": True}),
    ("mistral", {"num_key_value_heads": 1}),
]
IDS = [f"{fam}-" + "-".join(f"{k}={v}" for k, v in ov.items()) for fam, ov in CASES]


def hf_positions(mask: torch.Tensor) -> torch.Tensor:
    """verl/HF convention for padded rows: cumsum(mask) - 1, clamped at 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def padded_batch(lengths, seq_len, left: bool, vocab: int = 128, seed: int = 0):
    """(ids [B, T], mask [B, T]) with random real tokens and pad id 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        cols = slice(seq_len - n, seq_len) if left else slice(0, n)
        ids[i, cols] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, cols] = 1
    return ids, mask


def load_pair(folder, head="lm"):
    auto = (
        transformers.AutoModelForCausalLM
        if head == "lm"
        else transformers.AutoModelForTokenClassification
    )
    ref = auto.from_pretrained(folder).eval()
    ours = load_model(folder, head=head).eval()
    return ref, ours


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=IDS)
@pytest.mark.parametrize("left", [True, False], ids=["left_pad", "right_pad"])
def test_padded_batch_matches_transformers(hf_folder, family, overrides, left):
    ref, ours = load_pair(hf_folder(family, **overrides))
    ids, mask = padded_batch([11, 4, 8, 1], 11, left=left)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
        got = ours(ids, attention_mask=mask)  # default positions = cumsum(mask) - 1
    assert got.shape == (4, 11, 128) and got.dtype == torch.float32
    assert torch.isfinite(got).all(), "padding rows must stay finite"
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max() <= ATOL
    # the reference values are not trivially small: a wrong op would be visible at ATOL
    assert expected[real].abs().max() > 0.5


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=IDS)
def test_unmasked_batch_and_hidden_match_transformers(hf_folder, family, overrides):
    ref, ours = load_pair(hf_folder(family, **overrides))
    ids, _ = padded_batch([9, 9], 9, left=False, seed=1)
    with torch.no_grad():
        out = ref(input_ids=ids, output_hidden_states=True)
        got = ours(ids)
        hidden = ours(ids, output="hidden")
    assert (got - out.logits).abs().max() <= ATOL
    assert (hidden - out.hidden_states[-1]).abs().max() <= ATOL  # final-normed, as HF's last
    weight = ours.output_weight()
    assert weight.shape == (128, 64)
    assert (hidden @ weight.T - got).abs().max() <= ATOL


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=IDS)
def test_packed_rows_match_per_sequence(hf_folder, family, overrides):
    ref, ours = load_pair(hf_folder(family, **overrides))
    gen = torch.Generator().manual_seed(2)
    rows = [[5, 7, 2], [9, 4]]  # sequence lengths packed into each row, then padding
    seq_len = 16
    ids = torch.zeros(2, seq_len, dtype=torch.long)
    seg = torch.full_like(ids, -1)
    mask = torch.zeros_like(ids)
    pos = torch.zeros_like(ids)
    seqs = []
    for r, lengths in enumerate(rows):
        start = 0
        for s, n in enumerate(lengths):
            toks = torch.randint(3, 128, (n,), generator=gen)
            ids[r, start : start + n], seg[r, start : start + n] = toks, s
            mask[r, start : start + n], pos[r, start : start + n] = 1, torch.arange(n)
            seqs.append((r, start, toks))
            start += n
    with torch.no_grad():
        packed_default = ours(ids, segment_ids=seg, attention_mask=mask)
        packed_explicit = ours(ids, position_ids=pos, segment_ids=seg)
        assert torch.isfinite(packed_default).all() and torch.isfinite(packed_explicit).all()
        for r, start, toks in seqs:
            n = len(toks)
            expected = ref(input_ids=toks[None]).logits[0]
            alone = ours(toks[None])[0]
            assert (alone - expected).abs().max() <= ATOL
            assert (packed_default[r, start : start + n] - expected).abs().max() <= ATOL
            assert (packed_explicit[r, start : start + n] - expected).abs().max() <= ATOL


def test_llama3_rope_scaling_is_applied(hf_folder):
    folder = hf_folder("llama3")
    ours = load_model(folder)
    rs = ours.args.rope_scaling
    assert rs is not None and rs.factor == 8.0
    # the tiny config exercises all three bands: kept, interpolated, divided by factor
    inv_freq = 1.0 / ours.args.rope_theta ** (torch.arange(0, 16, 2).double() / 16)
    wavelen = 2 * torch.pi / inv_freq
    lo, hi = (
        rs.original_max_position_embeddings / rs.low_freq_factor,
        rs.original_max_position_embeddings / rs.high_freq_factor,
    )
    assert (
        (wavelen < hi).any() and (wavelen > lo).any() and ((wavelen >= hi) & (wavelen <= lo)).any()
    )
    ids, _ = padded_batch([40], 40, left=False, seed=3)
    unscaled = load_model(folder)
    unscaled.args.rope_scaling = None
    from megarl.models.model import rope_inv_freq

    unscaled._inv_freq = {torch.device("cpu"): rope_inv_freq(unscaled.args)}
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        assert (ours(ids) - expected).abs().max() <= ATOL
        assert (unscaled(ids) - expected).abs().max() > 1e-3  # scaling changes the answer


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_prm_head_matches_token_classification(hf_folder, family):
    ref, ours = load_pair(hf_folder(family, head="token_cls", num_labels=2), head="token_cls")
    assert ours.num_labels == 2 and ours.score.bias is not None
    ids, mask = padded_batch([10, 6, 3], 10, left=True, seed=4)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
        got = ours(ids, attention_mask=mask)
    assert got.shape == (3, 10, 2)
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max() <= ATOL


def _grad_check(ref, ours, loss_fn, ids, mask):
    ref.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    loss_fn(
        ref(input_ids=ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
    ).backward()
    loss_fn(ours(ids, attention_mask=mask)).backward()
    ref_params = dict(ref.named_parameters())
    ours_params = dict(ours.named_parameters())
    assert set(ours_params) == set(ref_params)  # same (HF) parameter names
    for name, p in ours_params.items():
        g_ref = ref_params[name].grad
        assert p.grad is not None, f"no gradient reached {name}"
        assert (p.grad - g_ref).abs().max() <= ATOL * max(1.0, g_ref.abs().max().item()), name
    return ours_params


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["no_ac", "activation_ckpt"])
def test_value_head_grads_match_transformers(hf_folder, family, ckpt):
    folder = hf_folder(family, head="token_cls", num_labels=1)
    ref = transformers.AutoModelForTokenClassification.from_pretrained(folder).eval()
    ours = load_model(folder, head="token_cls", activation_checkpointing=ckpt)
    ours.train()  # activation checkpointing only runs in train mode; we have no dropout
    assert ours.num_labels == 1  # read from config.json
    ids, mask = padded_batch([9, 5, 7], 9, left=True, seed=5)
    with torch.no_grad():
        values = ours(ids, attention_mask=mask)
    assert values.shape == (3, 9, 1)
    w = torch.randn(3, 9, generator=torch.Generator().manual_seed(6))

    def loss_fn(out):
        return ((out[..., 0] - w).pow(2) * mask).sum() / mask.sum()

    params = _grad_check(ref, ours, loss_fn, ids, mask)
    assert params["score.weight"].grad.abs().sum() > 0
    assert params["model.layers.0.self_attn.q_proj.weight"].grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("qwen2", {"tie_word_embeddings": True}), ("qwen3", {})],
    ids=["qwen2-tied", "qwen3"],
)
def test_lm_grads_match_transformers(hf_folder, family, overrides):
    folder = hf_folder(family, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = load_model(folder)
    ids, mask = padded_batch([8, 6], 8, left=False, seed=7)

    def loss_fn(logits):
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        tok = logp.gather(-1, ids[:, 1:, None])[..., 0]
        return -(tok * mask[:, 1:]).sum() / mask[:, 1:].sum()

    _grad_check(ref, ours, loss_fn, ids, mask)
    if overrides.get("tie_word_embeddings"):
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_activation_checkpointing_same_grads_as_plain(hf_folder):
    folder = hf_folder("qwen3")
    plain = load_model(folder).train()
    ckpt = load_model(folder, activation_checkpointing=True).train()
    ids, mask = padded_batch([7, 4], 7, left=True, seed=8)
    calls = []
    ckpt.model.layers["0"].register_forward_pre_hook(lambda *a: calls.append(1))
    for m in (plain, ckpt):
        m(ids, attention_mask=mask).logsumexp(-1).mul(mask).sum().backward()
    assert len(calls) == 2  # forward + recomputation in backward: checkpointing really ran
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=0), name


class RecordingCache:
    """A kv_cache that records the dtypes it is handed and runs plain causal attention."""

    def __init__(self):
        self.dtypes = set()

    def attend(self, layer_idx, q, k, v):
        self.dtypes.update({q.dtype, k.dtype, v.dtype})
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_bf16_forward_close_and_stays_bf16(hf_folder, family):
    folder = hf_folder(family)
    ref32 = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ref16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ours = load_model(folder, dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids, mask = padded_batch([12, 7], 12, left=True, seed=9)
    pos = hf_positions(mask)
    cache = RecordingCache()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
        e16 = ref16(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        e32 = ref32(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        ours(ids[:1], position_ids=pos[:1], kv_cache=cache)
    # post-RoPE q/k reach attention in bf16: fp32 cos/sin must not promote them
    assert got.dtype == torch.bfloat16 and cache.dtypes == {torch.bfloat16}
    real = mask.bool()
    # same op order as transformers: bf16 results agree to well under one bf16 ulp at |x| ~ 2
    assert (got[real].float() - e16[real].float()).abs().max() <= 5e-3
    assert (got[real].float() - e32[real]).abs().max() <= 0.15  # loose: bf16 vs fp32


def test_default_position_ids_brute_force():
    from megarl.models.model import default_position_ids

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 0, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 0, 1, 2]])
    assert torch.equal(default_position_ids((3, 5), torch.device("cpu"), mask), expected)
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [5, 5, 5, 5, 7, 7, 7, 7]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3]])
    assert torch.equal(default_position_ids((2, 8), torch.device("cpu"), None, seg), expected)
    assert torch.equal(
        default_position_ids((2, 3), torch.device("cpu")), torch.arange(3).expand(2, 3)
    )


def test_attention_mask_brute_force():
    from megarl.models.model import build_attention_mask

    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    seg = torch.tensor([[-1, 0, 0, 1, 1, -1], [3, 3, 3, 4, 4, 4]])
    got = build_attention_mask(mask, seg, 6)
    assert got.shape == (2, 1, 6, 6) and got.dtype == torch.bool
    for b in range(2):
        for i in range(6):
            for j in range(6):
                real = j <= i and mask[b, j] == 1 and seg[b, i] == seg[b, j]
                assert bool(got[b, 0, i, j]) == (real or i == j), (b, i, j)
    assert build_attention_mask(None, None, 6) is None
    assert build_attention_mask(torch.zeros(1, 4), None, 4)[0, 0].any(-1).all()  # no empty row


def test_fully_masked_row_is_finite(hf_folder):
    ours = load_model(hf_folder("qwen2"))
    ids, mask = padded_batch([6, 0], 6, left=True)
    with torch.no_grad():
        assert torch.isfinite(ours(ids, attention_mask=mask)).all()
        seg = torch.tensor([[0, 0, 0, 1, 1, -1], [-1] * 6])
        assert torch.isfinite(ours(ids, segment_ids=seg, attention_mask=(seg >= 0).long())).all()
