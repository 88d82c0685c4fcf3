"""Pure pieces of the megatron backend, property-tested: the shifted batch layout against a
brute-force loop, QKV / gate-up (un)packing and TP sharding, the LR schedule against its
written-out definition; plus several roles living in one process."""

import math

import mcore_testlib as lib
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.backends.protocol import Backend, SequenceBatch

pytest.importorskip("megatron.core")


@st.composite
def layouts(draw):
    B, P, L = draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 5))
    ids = torch.randint(3, 50, (B, P + L), generator=torch.Generator().manual_seed(draw(
        st.integers(0, 999))))
    mask = torch.zeros(B, P + L, dtype=torch.long)
    for i in range(B):
        p = draw(st.integers(0, P))
        r = draw(st.integers(0, L))
        mask[i, P - p : P + r] = 1
    return SequenceBatch(ids * mask, mask, L)


@settings(max_examples=60, deadline=None)
@given(batch=layouts(), pad=st.sampled_from([1, 2, 4]))
def test_shifted_layout_matches_brute_force(batch, pad):
    from megarl.backends.megatron.batching import to_micro_batch

    mb = to_micro_batch(batch, torch.device("cpu"), pad_multiple=pad)
    assert mb.seq_len % pad == 0
    L = batch.response_length
    P = batch.input_ids.shape[1] - L
    expected_pred, expected_cls = [], []
    for i in range(batch.batch_size):
        real = [c for c in range(P + L) if batch.attention_mask[i, c]]
        row = [int(batch.input_ids[i, c]) for c in real]
        assert mb.input_ids[i, : len(row)].tolist() == row
        assert int(mb.input_ids[i, len(row) :].abs().sum()) == 0
        for j in range(L):
            col = P + j
            if not batch.attention_mask[i, col]:
                continue
            shifted = real.index(col)
            expected_cls.append((i, j, shifted))
            if shifted > 0:
                expected_pred.append((i, j, shifted - 1, int(batch.input_ids[i, col])))
    got_pred = list(zip(mb.rows.tolist(), mb.resp_cols.tolist(), mb.pred_cols.tolist(),
                        mb.labels.tolist()))
    got_cls = list(zip(mb.cls_rows.tolist(), mb.cls_resp_cols.tolist(), mb.cls_tok_cols.tolist()))
    assert got_pred == expected_pred and got_cls == expected_cls


@settings(max_examples=40, deadline=None)
@given(groups=st.sampled_from([1, 2, 4]), rep=st.integers(1, 3), hd=st.sampled_from([2, 4]),
       tp=st.sampled_from([1, 2, 4]), bias=st.booleans())
def test_qkv_and_fc1_shards_reassemble_exactly(groups, rep, hd, tp, bias):
    from megarl.backends.megatron.weights import Entry, hf_from_shards, shard_from_hf
    from megarl.models.args import ModelArgs

    if groups % tp:
        return
    h = 8
    args = ModelArgs(model_type="llama", vocab_size=4 * tp, hidden_size=h,
                     intermediate_size=2 * tp, num_hidden_layers=1,
                     num_attention_heads=groups * rep, num_key_value_heads=groups, head_dim=hd)
    tail = () if bias else (h,)
    tensors = {
        "q": torch.randn(groups * rep * hd, *tail), "k": torch.randn(groups * hd, *tail),
        "v": torch.randn(groups * hd, *tail), "g": torch.randn(2 * tp, h),
        "u": torch.randn(2 * tp, h),
    }

    def read(name, rows, cols):
        t = tensors[name]
        t = t if rows is None else t[rows]
        return t if cols is None else t[:, cols]

    for entry, names in ((Entry("x", ("q", "k", "v"), "qkv", 0), "qkv"),
                         (Entry("y", ("g", "u"), "fc1", 0), "gu")):
        shards = [shard_from_hf(entry, read, args, r, tp) for r in range(tp)]
        back = dict(hf_from_shards(entry, shards, args))
        for n in names:
            assert torch.equal(back[n], tensors[n])
    # megatron's per-group order on one rank: [q heads of the group, k, v]
    if tp == 1:
        packed = shard_from_hf(Entry("x", ("q", "k", "v"), "qkv", 0), read, args, 0, 1)
        first = packed[: (rep + 2) * hd]
        assert torch.equal(first[: rep * hd], tensors["q"][: rep * hd])
        assert torch.equal(first[rep * hd : (rep + 1) * hd], tensors["k"][:hd])


@settings(max_examples=60, deadline=None)
@given(lr=st.floats(1e-6, 1.0), warmup=st.integers(-1, 5), ratio=st.floats(0, 0.5),
       total=st.integers(1, 20), kind=st.sampled_from(["constant", "cosine"]),
       floor=st.floats(0, 1), step=st.integers(0, 25))
def test_lr_schedule_follows_its_definition(lr, warmup, ratio, total, kind, floor, step):
    from megarl.backends.megatron.optim import OptimSettings

    s = OptimSettings.coerce({
        "lr": lr, "lr_warmup_steps": warmup, "lr_warmup_steps_ratio": ratio,
        "total_training_steps": total, "lr_scheduler_type": kind, "min_lr_ratio": floor,
    })
    W = warmup if warmup >= 0 else int(ratio * total)
    if step < W:
        want = lr * step / W
    elif kind == "constant":
        want = lr
    else:
        p = min(1.0, (step - W) / max(1, total - W))
        want = lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))
    assert s.lr_at(step) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_warmup_style_alias_and_bad_scheduler():
    from megarl.backends.megatron.optim import OptimSettings

    assert OptimSettings.coerce({"warmup_style": "cosine"}).lr_scheduler_type == "cosine"
    assert OptimSettings.coerce({"grad_clip": None}).grad_clip is None  # None = no clipping
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        OptimSettings.coerce({"lr_scheduler_type": "linear"})


def test_all_roles_coexist_in_one_process(zoo, mcore_dist):
    from megarl.backends.megatron import MegatronBackend

    batch = lib.make_batch(seed=20)
    actor = MegatronBackend("actor", str(lib.zoo_model(zoo, "qwen2_bias")),
                            optim={"grad_clip": 0})
    ref = MegatronBackend("ref", str(lib.zoo_model(zoo, "qwen2_bias")))
    critic = MegatronBackend("critic", str(lib.zoo_model(zoo, "qwen2_critic")))
    prm = MegatronBackend("prm", str(lib.zoo_model(zoo, "qwen3_prm")))
    for be in (actor, ref, critic, prm):
        assert isinstance(be, Backend) and be.dp_size == 1 and be.dp_rank == 0
    lp_ref = ref.logprobs(batch)[0]
    assert torch.equal(actor.logprobs(batch)[0], lp_ref)
    n = float(batch.response_mask.sum())
    empty = SequenceBatch(batch.input_ids[:1] * 0, batch.attention_mask[:1] * 0,
                          batch.response_length)  # a fully masked padding micro-batch
    m = actor.train_step([batch, empty], lambda o, mb: lib.pg_loss(o, mb, n))
    assert m["tokens"] == n and m["skipped"] == 0.0
    batch.tensors["returns"] = torch.zeros(batch.response_mask.shape)
    critic.train_step([batch], lambda o, mb: lib.value_loss(o, mb, n))
    assert prm.token_scores(batch).shape[-1] == 2
    assert not torch.equal(actor.logprobs(batch)[0], lp_ref)  # the actor moved
    assert torch.equal(ref.logprobs(batch)[0], lp_ref)  # the ref did not
    with pytest.raises(ValueError, match="same tensor_model_parallel_size"):
        MegatronBackend("ref", str(lib.zoo_model(zoo, "qwen2_bias")), tp=2)


def test_a_new_process_group_gets_new_megatron_groups(zoo, mcore_dist):
    """A second run in one process (the trainer destroys its process group at the end)."""
    import torch.distributed as dist

    from megarl.backends.megatron import MegatronBackend

    path = str(lib.zoo_model(zoo, "qwen2_bias"))
    batch = lib.make_batch(seed=21)
    before = MegatronBackend("ref", path).logprobs(batch)[0]
    dist.destroy_process_group()
    lib.ensure_dist()
    assert torch.equal(MegatronBackend("ref", path).logprobs(batch)[0], before)
