"""The torch engine keeps sampled tokens on the device: host reads per generate call, and the
outputs against the loop that read every token back when it was sampled.

On a GPU a read of the device from the host (``.tolist()``, ``.item()``, ``int(t)``) waits for
every queued kernel, so a decode loop that reads per token runs the host and the GPU in turn.
Here the reads are counted on the CPU (the calls are the same on every device): without a
possible stop (``ignore_eos``, no stop ids or strings) a whole generate call reads the device
twice (tokens and logprobs once at the end), however many tokens it samples; with stop ids,
once more per sampling call (the stop flags that decide which sequences leave the batch).

`_host_loop` is the reference: the engine's scheduling (admission, prefill chunks by length
under the token budget, retire-and-compact) written with every sampled token read to the host
at once, as the engine did before; the engine must give its tokens, logprobs, finish reasons
and recorded experts bit for bit (same kernels on the same shapes in the same order).
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
from rollout_helpers import prompts_of
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.models.moe import record_experts, routing_dtype, sparse_layers, stack_layers
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.sampling import noise_key, sample_next, uniform_at
from megarl.rollout.torch import TorchRolloutEngine
from megarl.rollout.torch.kv_cache import SlotKVCache
from megarl.rollout.torch.stopping import StopStrings

# ----------------------------------------------------------------------- counting host reads


class _ScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _count_reads(monkeypatch, engine, *args, **kwargs):
    """(completions, host reads of tensors during ``engine.generate``)."""
    tolist = torch.Tensor.tolist
    calls = [0]

    def counted(self):
        calls[0] += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    with _ScalarReads() as scalars:
        out = engine.generate(*args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return out, calls[0] + scalars.count


@pytest.fixture()
def engine(tiny_folder):
    torch.set_num_threads(1)
    return TorchRolloutEngine.from_pretrained(tiny_folder("qwen2"), max_num_seqs=3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_read_per_token_without_a_possible_stop(monkeypatch, engine, temperature):
    """ignore_eos, no stop ids or strings: 5 sequences x 24 tokens through 3 slots (two
    admissions after the first prefill) read the device twice in all, at the end. Before the
    fix: 3 reads per decode step (the cache's max position, the tokens, the logprobs): 96."""
    sp = SamplingParams(n=1, temperature=temperature, max_new_tokens=24, seed=3,
                        ignore_eos=True)
    out, reads = _count_reads(monkeypatch, engine, prompts_of([4, 7, 5, 9, 3], seed=1), sp)
    assert [len(c.token_ids) for c in out] == [24] * 5
    assert reads == 2


def test_one_read_per_step_with_stop_ids(monkeypatch, engine):
    """With stop ids, one read (the stop flags) per sampling call plus the two at the end;
    sampling calls are counted from the schedule: the prefills plus one decode per step.
    Before the fix: 3 per decode step and 2 per prefill (62 against 33 now)."""
    prompts = prompts_of([4, 7, 5, 9, 3], seed=2)
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=24, seed=5,
                        stop_token_ids=list(range(10, 14)))
    calls = []
    real = SlotKVCache.begin_decode, SlotKVCache.begin_prefill

    def decode(self, *a, **k):
        calls.append("decode")
        return real[0](self, *a, **k)

    def prefill(self, *a, **k):
        calls.append("prefill")
        return real[1](self, *a, **k)

    monkeypatch.setattr(SlotKVCache, "begin_decode", decode)
    monkeypatch.setattr(SlotKVCache, "begin_prefill", prefill)
    out, reads = _count_reads(monkeypatch, engine, prompts, sp)
    assert {c.finish_reason for c in out} == {"stop", "length"}  # both kinds happen
    assert calls.count("prefill") >= 2  # sequences were admitted into freed slots
    assert reads == len(calls) + 2


# ----------------------------------------------------------------------- the reference loop


def _host_loop(e: TorchRolloutEngine, prompts, sp: SamplingParams, keys) -> list[tuple]:
    """(tokens, logprobs [float32], finish reason, routing or None) per (prompt, sample),
    prompt-major: the engine's schedule with each token read to the host when sampled."""
    stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(e.eos_token_ids))
    stops = StopStrings(e.tokenizer, list(sp.stop))
    seqs = [{"p": p, "req": i, "max": min(sp.max_new_tokens, e.max_model_len - len(p)),
             "key": noise_key(sp.seed or 0, keys[i], j), "tok": [], "lp": [], "fin": None, "r": []}
            for i, p in enumerate(prompts) for j in range(sp.n)]
    slots = min(e.max_num_seqs, len(seqs))
    max_len = max(len(s["p"]) + s["max"] for s in seqs)
    a = e.model.args
    cache = SlotKVCache(len(e.model.model.layers), slots, a.num_key_value_heads, max_len,
                        a.head_dim, e.dtype, e.device)

    def forward(ids, pos):
        if not e.return_routed_experts:
            return e.model(ids, position_ids=pos, kv_cache=cache, output="hidden"), None
        with record_experts(e.model) as chosen:
            h = e.model(ids, position_ids=pos, kv_cache=cache, output="hidden")
        return h, stack_layers(chosen, a)

    def sample(sids, logits):
        u = None
        if not sp.is_greedy:
            u = torch.tensor([uniform_at(seqs[s]["key"], len(seqs[s]["tok"])) for s in sids],
                             dtype=torch.float64)
        toks, lps = sample_next(logits, sp, u)
        for s, t, lp in zip(sids, toks.tolist(), lps.tolist()):
            q = seqs[s]
            q["tok"].append(t)
            q["lp"].append(lp)
            if t in stop_ids or (stops and stops.hit(q["tok"])):
                q["fin"] = "stop"
            elif len(q["tok"]) >= q["max"]:
                q["fin"] = "length"

    def cached(s):
        return len(seqs[s]["p"]) + len(seqs[s]["tok"]) - 1

    def prefill(new, first):
        by_req = {}
        for k, sid in enumerate(new):
            by_req.setdefault(seqs[sid]["req"], []).append(k)
        reqs = sorted(by_req, key=lambda r: len(seqs[new[by_req[r][0]]]["p"]))
        chunks, chunk = [], []
        for r in reqs:
            if chunk and (len(chunk) + 1) * len(seqs[new[by_req[r][0]]]["p"]) > \
                    e.prefill_token_budget:
                chunks.append(chunk)
                chunk = []
            chunk.append(r)
        for part in [*chunks, chunk]:
            ps = [seqs[new[by_req[r][0]]]["p"] for r in part]
            t = max(map(len, ps))
            ids = torch.zeros(len(ps), t, dtype=torch.long)
            for row, p in enumerate(ps):
                ids[row, : len(p)] = torch.tensor(p)
            pairs = [(first + k, row, new[k]) for row, r in enumerate(part) for k in by_req[r]]
            cache.begin_prefill([d for d, _, _ in pairs], [r for _, r, _ in pairs])
            h, routing = forward(ids, torch.arange(t).expand(len(ps), t))
            if routing is not None:
                routing = routing.view(len(ps), t, *routing.shape[1:])
                for _, row, sid in pairs:
                    seqs[sid]["r"].append(routing[row, : len(ps[row])])
            last = e._logits(h[torch.arange(len(ps)), torch.tensor(list(map(len, ps))) - 1])
            sample([sid for _, _, sid in pairs], last[torch.tensor([r for _, r, _ in pairs])])

    def retire(active):
        n = sum(seqs[s]["fin"] is None for s in active)
        holes = [i for i in range(n) if seqs[active[i]]["fin"] is not None]
        movers = [i for i in range(n, len(active)) if seqs[active[i]]["fin"] is None]
        cache.move(movers, holes, [cached(active[m]) for m in movers])
        out = active[:n]
        for h, m in zip(holes, movers):
            out[h] = active[m]
        return out

    pending, active = deque(range(len(seqs))), []
    with torch.inference_mode():
        while pending or active:
            if pending and len(active) < slots:
                new = [pending.popleft() for _ in range(min(len(pending), slots - len(active)))]
                prefill(new, len(active))
                active = retire(active + new)
                if pending and len(active) < slots:
                    continue
            if active:
                pos = torch.tensor([cached(s) for s in active])
                cache.begin_decode(pos, int(pos.max()) + 1)
                ids = torch.tensor([[seqs[s]["tok"][-1]] for s in active])
                h, routing = forward(ids, pos[:, None])
                if routing is not None:
                    for s, r in zip(active, routing.split(1)):
                        seqs[s]["r"].append(r)
                sample(active, e._logits(h[:, -1]))
                active = retire(active)
    pad = torch.full((1, len(sparse_layers(a)), a.num_experts_per_tok), -1,
                     dtype=routing_dtype(a.num_experts))
    return [(s["tok"], torch.tensor(s["lp"], dtype=torch.float32), s["fin"] or "length",
             torch.cat([*s["r"], pad]) if e.return_routed_experts else None) for s in seqs]


CASES = {
    "greedy": SamplingParams(n=2, temperature=0.0, max_new_tokens=20),
    "sampled": SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=5),
    "top_k": SamplingParams(n=2, temperature=0.8, top_k=5, max_new_tokens=24, seed=7),
    "top_p": SamplingParams(n=2, temperature=1.2, top_p=0.7, max_new_tokens=24, seed=9),
    "stop_ids": SamplingParams(n=2, temperature=1.0, max_new_tokens=30, seed=3,
                               stop_token_ids=list(range(10, 18))),
    "stop_strings": SamplingParams(n=2, temperature=1.0, max_new_tokens=30, seed=3,
                                   stop=["a", "b", "c"]),
    "ignore_eos": SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=4,
                                 ignore_eos=True),
}


@pytest.mark.parametrize("family, max_num_seqs, budget", [
    ("qwen2", 16, 16384), ("qwen2", 3, 16384), ("llama", 2, 12), ("qwen3_moe", 3, 12)])
def test_outputs_equal_the_per_token_host_loop(tiny_folder, family, max_num_seqs, budget):
    """Bit for bit, every case: tokens, logprobs, finish reasons and (MoE) recorded experts.
    Up to 16 slots (one batch), 3 or 2 (sequences admitted into freed slots), a prefill budget
    of 12 tokens (one prompt per chunk). The cases reach both finish reasons and several
    lengths (asserted), so the schedule really changes inside a call. Planted: moving the
    retire compaction's last tokens to the wrong slot, or dropping it, changes the tokens."""
    torch.set_num_threads(1)
    moe = family == "qwen3_moe"
    e = TorchRolloutEngine.from_pretrained(tiny_folder(family), max_num_seqs=max_num_seqs,
                                           prefill_token_budget=budget,
                                           return_routed_experts=moe)
    prompts, keys = prompts_of([5, 9, 3, 7, 4], seed=11), [3, 1, 4, 1, 5]
    reasons, lengths = set(), set()
    for name, sp in CASES.items():
        got = e.generate(prompts, sp, prompt_keys=keys)
        want = _host_loop(e, prompts, sp, keys)
        assert len(got) == len(want)
        for c, (tok, lp, fin, routing) in zip(got, want):
            assert c.token_ids == tok, name
            assert torch.equal(c.logprobs, lp), name
            assert c.finish_reason == fin, name
            if moe:
                assert torch.equal(c.routed_experts, routing), name
            reasons.add(fin)
            lengths.add(len(tok))
    assert reasons == {"stop", "length"} and len(lengths) > 5
