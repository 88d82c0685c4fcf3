"""Packed-row attention through `SegmentGrid` (causal attention per segment, no T x T mask).

References: a float64 softmax-attention loop over each segment written out by hand, the dense
block-diagonal mask path (values and gradients), and transformers run on each sequence alone.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.models import load_model
from megarl.models.model import SegmentGrid, attention_layout, build_attention_mask


def reference_attention(q, k, v, segment_ids, scale):
    """Float64 loop: each query attends to the earlier-or-equal keys of its own contiguous run."""
    b, nh, t, hd = q.shape
    rep = nh // k.shape[1]
    out = torch.zeros(b, nh, t, hd, dtype=torch.float64)
    for r in range(b):
        ids = segment_ids[r].tolist()
        start = 0
        for i in range(t):
            if i > 0 and ids[i] != ids[i - 1]:
                start = i
            for h in range(nh):
                keys = k[r, h // rep, start : i + 1].double()
                scores = keys @ q[r, h, i].double() * scale
                w = torch.softmax(scores, 0)
                out[r, h, i] = w @ v[r, h // rep, start : i + 1].double()
    return out


def layouts():
    """Rows of contiguous runs (distinct ids per row, the tail may be a -1 padding run)."""
    run = st.integers(1, 9)
    row = st.lists(run, min_size=1, max_size=6)
    return st.tuples(st.lists(row, min_size=1, max_size=3), st.booleans())


def to_segment_ids(rows, pad_tail):
    width = max(sum(r) for r in rows) + (2 if pad_tail else 0)
    seg = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, runs in enumerate(rows):
        col = 0
        for s, n in enumerate(runs):
            seg[i, col : col + n] = s
            col += n
        if not pad_tail and col < width:  # fill the rest as one more segment
            seg[i, col:] = len(runs)
    return seg


@settings(max_examples=40, deadline=None)
@given(layouts(), st.sampled_from([(4, 4), (4, 2), (4, 1)]), st.integers(0, 2**16))
def test_grid_matches_per_segment_softmax(layout, heads, seed):
    seg = to_segment_ids(*layout)
    b, t = seg.shape
    nh, nkv = heads
    hd = 8
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, t, hd, generator=gen, dtype=torch.float64)
    k = torch.randn(b, nkv, t, hd, generator=gen, dtype=torch.float64)
    v = torch.randn(b, nkv, t, hd, generator=gen, dtype=torch.float64)
    lengths = [len(list(g)) for row in seg.tolist() for _, g in itertools.groupby(row)]
    grid = SegmentGrid.build(seg)
    if grid is None:  # only when the grid would cost more than the T x T mask
        assert len(lengths) * max(lengths) ** 2 > b * t * t
        return
    runs = len(lengths)
    assert grid.num_segments == runs
    got = grid.attend(q, k, v, 1 / math.sqrt(hd))
    want = reference_attention(q, k, v, seg, 1 / math.sqrt(hd))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("rows", [[[8, 8, 6, 10], [6, 10, 8, 8]], [[30]], [[3, 5, 4, 2, 6, 4]]])
def test_grid_values_and_gradients_match_dense_mask(rows):
    seg = to_segment_ids(rows, pad_tail=False)
    b, t = seg.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (4, 2, 2))
    grid = attention_layout(None, seg, t)
    assert isinstance(grid, SegmentGrid)
    got = grid.attend(q, k, v, 8**-0.5)
    mask = build_attention_mask(None, seg, t)
    dense = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=8**-0.5)
    torch.testing.assert_close(got, dense, atol=1e-12, rtol=0)
    w = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    g_grid = torch.autograd.grad((got * w).sum(), (q, k, v))
    g_dense = torch.autograd.grad((dense * w).sum(), (q, k, v))
    for a, d in zip(g_grid, g_dense):
        torch.testing.assert_close(a, d, atol=1e-12, rtol=0)


def test_dense_mask_when_grid_does_not_apply():
    split = torch.tensor([[0, 0, 1, 1, 0, 0]])  # id 0 in two runs: the mask lets them attend
    assert SegmentGrid.build(split) is None
    assert isinstance(attention_layout(None, split, 6), torch.Tensor)
    skewed = torch.tensor([list(range(30)) + [99] * 30])  # 31 runs x 30^2 > 60^2
    assert SegmentGrid.build(skewed) is None
    packed = torch.tensor([[0] * 4 + [1] * 4])
    assert isinstance(attention_layout(torch.ones(1, 8), packed, 8), torch.Tensor)  # with a mask
    assert attention_layout(None, None, 8) is None


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_packed_model_uses_grid_and_matches_transformers(hf_folder, family):
    folder = hf_folder(family)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = load_model(folder).eval()
    gen = torch.Generator().manual_seed(3)
    lengths = [7, 9, 6, 8, 5]
    toks = [torch.randint(3, 128, (n,), generator=gen) for n in lengths]
    ids = torch.cat(toks)[None]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    assert isinstance(attention_layout(None, seg, ids.shape[1]), SegmentGrid)
    with torch.no_grad():
        packed = ours(ids, position_ids=pos, segment_ids=seg)
        start = 0
        for t in toks:
            expected = ref(input_ids=t[None]).logits[0]
            assert (packed[0, start : start + len(t)] - expected).abs().max() <= 1e-5
            start += len(t)
