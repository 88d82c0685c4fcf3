"""Two kinds of demo outcome reward model (ORM), measured, neither shipped as a demo asset
(docs/demo.md, "An outcome reward model for the demo").

Trained (`sample_responses`, `label_samples`, `train_orm`, `ranking_loss`): the policy's body
with a 1-label head trained on the policy's own T=1 samples labelled by the arith verifier (BCE
on the outcome, dense "still on the reference path" labels, a within-problem ranking loss). It
orders a correct sample of a problem above a wrong one only ~0.5-0.6 of the time
(`pairwise_accuracy`), too weak for GRPO.

Built (`surprise_orm`): a ``Qwen2ForSequenceClassification`` whose score is how expected the
whole text is to a stronger arithmetic model, the mean over the sequence's positions of that
model's logit of the token written there. It is constructed, not trained on correct / wrong
answers: the stronger model (the SFT policy after a few hundred more SFT steps) is copied into
half of a twice-as-wide body, and two added layers compute the logit of each written token and
average it. On the demo it ranks pairs at 0.82-0.84 and GRPO learns from its score alone.

Input/score. As ``megarl.trainer.outcome_rm`` reads it (and transformers'
``*ForSequenceClassification``): chat-templated prompt + response tokens (with the ``<|im_end|>``
the policy ended with), the score head at the last token. Training rows are left-padded whole,
so the last column is every row's last token.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from megarl.data.batching import pad_left
from megarl.data.tokenizer import render_prompt
from megarl.demo.arith import SEP, Problem
from megarl.demo.greedy import generate
from megarl.demo.prm import prefix_labels
from megarl.rewards.math_score import math_score


@dataclass
class ORMExample:
    problem: int  # index of the problem (samples of one problem share it)
    prompt_ids: list[int]
    response_ids: list[int]  # as sampled: ends with eos unless cut at the length limit
    correct: int  # the verifier's outcome (1 = the boxed answer is right)
    token_labels: list[int]  # one per response token: prefix-of-reference, last = correct


def prompt_ids(problems: Sequence[Problem], tokenizer) -> list[list[int]]:
    """Chat-templated prompt token ids, as the trainer renders them."""
    texts = [render_prompt(tokenizer, [{"role": "user", "content": p.prompt}])
             for p in problems]
    return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def sample_responses(model, prompts: Sequence[Sequence[int]], n: int, eos_id: int, pad_id: int,
                     max_new_tokens: int, temperature: float = 1.0, seed: int = 0,
                     batch_size: int = 512) -> list[list[list[int]]]:
    """``n`` sampled continuations of each prompt (softmax(logits / temperature), the rollout's
    distribution at top_p=1), each up to and including eos: result[i][j] is sample j of prompt
    i. Deterministic given ``seed`` and the thread count."""
    gen = torch.Generator().manual_seed(seed)

    def draw(logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float() / temperature, -1)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    flat = [list(p) for p in prompts for _ in range(n)]
    out = generate(model, flat, eos_id, pad_id, max_new_tokens, batch_size, pick=draw)
    return [out[i * n : (i + 1) * n] for i in range(len(prompts))]


def label_samples(problems: Sequence[Problem], prompts: Sequence[Sequence[int]],
                  samples: Sequence[Sequence[Sequence[int]]], tokenizer) -> list[ORMExample]:
    """One `ORMExample` per sample: outcome from the rule reward (``math_score`` of the decoded
    response against the answer), dense labels from ``prefix_labels`` against the reference
    solution's tokens, the last one replaced by the outcome."""
    out = []
    for k, (p, pr, group) in enumerate(zip(problems, prompts, samples)):
        ref = tokenizer.encode(SEP.join(p.steps()), add_special_tokens=False)
        ref = ref + [tokenizer.eos_token_id]
        for resp in group:
            if not resp:
                continue
            text = tokenizer.decode(resp, skip_special_tokens=True)
            correct = int(math_score(text, str(p.answer)))
            labels = prefix_labels(resp, ref)
            labels[-1] = correct
            out.append(ORMExample(k, list(pr), list(resp), correct, labels))
    return out


def orm_batch(examples: Sequence[ORMExample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T], mask [B, T], labels [B, T] float) of prompt + response left-padded whole
    (pad id 0, masked), so column -1 is each row's last token; labels hold the response tokens'
    ``token_labels`` and -1 (ignored) on prompt and padding."""
    rows = [e.prompt_ids + e.response_ids for e in examples]
    ids, mask = pad_left(rows, 0)
    labels = torch.full(ids.shape, -1.0)
    for i, e in enumerate(examples):
        labels[i, ids.shape[1] - len(e.response_ids):] = torch.as_tensor(e.token_labels,
                                                                          dtype=torch.float32)
    return ids, mask, labels


def orm_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] score logits at every position (column -1: the ORM's score)."""
    return model(ids, attention_mask=mask)[..., 0]


def new_orm(policy_dir: str | Path, seed: int):
    """The policy's body with a fresh 1-label, bias-free score head (N(0, initializer_range)
    from ``seed``), saved by ``save_model`` as a ``Qwen2ForSequenceClassification``."""
    from megarl.models import load_model, read_hf_config

    config = dict(read_hf_config(policy_dir))
    arch = str((config.get("architectures") or ["Qwen2ForCausalLM"])[0])
    config["architectures"] = [arch.removesuffix("ForCausalLM") + "ForSequenceClassification"]
    config["num_labels"] = 1
    return load_model(policy_dir, head="token_cls", num_labels=1, allow_new_head=True,
                      seed=seed, hf_config=config)


def rank_key(e: ORMExample) -> tuple[int, int]:
    """What the ranking loss orders samples of one problem by: the outcome, then the number of
    leading response tokens on the reference path (partial credit: a wrong solution that left
    the path later ranks above one that left it earlier)."""
    prefix = e.token_labels.index(0) if 0 in e.token_labels else len(e.token_labels)
    return e.correct, prefix


def group_examples(examples: Sequence[ORMExample]) -> list[list[int]]:
    """Indices of ``examples`` per problem (the GRPO groups), in first-seen order."""
    groups: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(e.problem, []).append(i)
    return list(groups.values())


def ranking_loss(scores: torch.Tensor, keys: Sequence[tuple[int, int]],
                 groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """Bradley-Terry loss -log sigmoid(s_i - s_j), averaged over the pairs (i, j) of one group
    with key_i > key_j; scores [B] are indexed by ``groups``' positions. 0 without pairs."""
    hi, lo = [], []
    for g in groups:
        for i in g:
            for j in g:
                if keys[i] > keys[j]:
                    hi.append(i)
                    lo.append(j)
    if not hi:
        return scores.sum() * 0.0
    return -F.logsigmoid(scores[hi] - scores[lo]).mean()


def train_orm(model, examples: Sequence[ORMExample], steps: int, groups_per_batch: int = 8,
              lr: float = 1e-3, warmup: int = 20, rank_weight: float = 1.0,
              dense_weight: float = 0.0, outcome_weight: float = 0.0, seed: int = 0,
              log: Callable[[str], None] | None = None,
              eval_fn: Callable[[int], None] | None = None, eval_every: int = 100) -> float:
    """AdamW on whole groups (every sample of ``groups_per_batch`` problems): ``rank_weight`` x
    the ranking loss within each group (`ranking_loss` by `rank_key`), plus ``outcome_weight``
    x the binary cross-entropy of the outcome at the last token and ``dense_weight`` x that of
    the prefix labels at the other response tokens. ``eval_fn(step)`` runs every
    ``eval_every`` steps (its time is not counted). Returns seconds spent training."""
    rng = np.random.Generator(np.random.PCG64(seed))
    groups = group_examples(examples)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)))
    model.train()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        chosen = [groups[i] for i in rng.choice(len(groups), size=groups_per_batch,
                                                 replace=False)]
        batch = [examples[i] for g in chosen for i in g]
        local, k = [], 0
        for g in chosen:
            local.append(list(range(k, k + len(g))))
            k += len(g)
        ids, mask, labels = orm_batch(batch)
        logits = orm_logits(model, ids, mask).float()
        loss = logits.sum() * 0.0
        if rank_weight:
            loss = loss + rank_weight * ranking_loss(logits[:, -1], [rank_key(e) for e in batch],
                                                     local)
        if outcome_weight:
            loss = loss + outcome_weight * F.binary_cross_entropy_with_logits(
                logits[:, -1], labels[:, -1])
        if dense_weight:
            body = labels[:, :-1]
            keep = body >= 0
            loss = loss + dense_weight * F.binary_cross_entropy_with_logits(
                logits[:, :-1][keep], body[keep])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log and (step % 100 == 0 or step == steps):
            log(f"  orm step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
        if eval_fn is not None and step % eval_every == 0:
            t1 = time.perf_counter()
            eval_fn(step)
            model.train()
            t0 += time.perf_counter() - t1
    return time.perf_counter() - t0


@torch.no_grad()
def orm_scores(model, examples: Sequence[ORMExample], batch_size: int = 512) -> torch.Tensor:
    """[N] float32: the score (last-token logit) of each example."""
    was = model.training
    model.eval()
    out = []
    for s in range(0, len(examples), batch_size):
        ids, mask, _ = orm_batch(examples[s : s + batch_size])
        out.append(orm_logits(model, ids, mask)[:, -1].float())
    model.train(was)
    return torch.cat(out) if out else torch.zeros(0)


def pairwise_accuracy(examples: Sequence[ORMExample], scores: torch.Tensor) -> dict[str, float]:
    """Over every (correct, wrong) pair of samples of the same problem: the share the score
    ranks correct above wrong (ties count half), what a GRPO group's advantages depend on; also
    the number of such pairs, of problems with one, and the share of correct samples."""
    by_problem: dict[int, tuple[list[float], list[float]]] = {}
    for e, s in zip(examples, scores.tolist()):
        by_problem.setdefault(e.problem, ([], []))[e.correct].append(s)
    wins, pairs, groups = 0.0, 0, 0
    for wrong, right in by_problem.values():
        if not wrong or not right:
            continue
        groups += 1
        w = np.asarray(wrong)
        for r in right:
            wins += float((r > w).sum()) + 0.5 * float((r == w).sum())
            pairs += len(w)
    return {"pairwise_accuracy": wins / max(pairs, 1), "pairs": pairs, "problems": groups,
            "correct_share": float(np.mean([e.correct for e in examples])) if examples else 0.0}


# ----------------------------------------------------------------- the built ORM


def response_token_ids(problems: Sequence[Problem], tokenizer) -> list[int]:
    """Sorted ids of every token in the reference solutions of ``problems``, of each of the
    characters ``0-9+-=`` alone, and eos: the vocabulary a demo response is written in (digits,
    ``+-=``, the separator, ``\\boxed{}``)."""
    ids = {int(tokenizer.eos_token_id)}
    for ch in "0123456789+-=":
        ids |= set(tokenizer.encode(ch, add_special_tokens=False))
    for p in problems:
        ids |= set(tokenizer.encode(p.solution, add_special_tokens=False))
    return sorted(ids)


def surprise_orm(lm, token_ids: Sequence[int], copy_scale: float = 1e-3, const: float = 1e4,
                 rope_amp: float = 300.0, rope_pairs: int = 6):
    """A 1-label sequence classifier (``token_cls`` head, saved as a
    ``Qwen2ForSequenceClassification``) scoring, at every position t, the mean over positions
    s <= t of ``lm``'s logit of token s given tokens < s (position 0: the logit of itself after
    itself). Read at the last token: how expected the whole text is to ``lm``.

    ``lm``: a tied-embedding qwen2 `megarl.models.Transformer` with an LM head, hidden size H,
    L layers. The result has hidden size 2H and L + 2 layers (same heads and head size):

    * dims [0, H) run ``lm`` unchanged: its weights zero-padded, its norm weights divided by
      sqrt(2) (RMSNorm over 2H dims of which only H are non-zero divides by rms/sqrt(2));
    * dims C = [H, H+r) carry ``copy_scale`` x the token's embedding in coordinates of an
      orthonormal basis P [r, H] of the rows of ``token_ids`` (small enough not to move the
      norms: relative error ~copy_scale^2);
    * layer L, attention: a head with constant query/key (q, k biases; weights 0) whose RoPE
      score A cos((i - j - 1) theta) over the ``rope_pairs`` fastest frequencies peaks at the
      previous position j = i - 1 (A = ``rope_amp``: every other position is >= ~25 logits
      lower); its value is P of the input normalised as ``lm``'s final norm does, i.e. of the
      state ``lm`` reads its logits from, written to dims A = [H+r, H+2r). A value bias writes
      the constant ``const`` to dim K, which from here on sets every RMSNorm's scale (to within
      |h|^2 / const^2 ~ 1e-6);
    * layer L, MLP: silu(a) b - silu(-a) b = a b exactly, so pairs of gate/up rows give
      z = sum_k A_k C_k = logit of the written token (P u . P e = u . e for the rows of
      ``token_ids``; other tokens: their projection), written to dim Z;
    * layer L + 1: a head with zero query/key (uniform over the visible positions) averages Z
      into dim S; the final norm and the score head read S.

    Exact in float32 to ~1e-4 relative (the test checks against ``lm``'s logits)."""
    from megarl.models import Transformer
    from megarl.models.loading import hf_config_for

    a0 = lm.args
    if lm.head != "lm" or not a0.tie_word_embeddings or a0.model_type != "qwen2":
        raise ValueError("surprise_orm needs a tied-embedding qwen2 LM (the demo policy)")
    H0, L0, hd = a0.hidden_size, a0.num_hidden_layers, a0.head_dim
    H = 2 * H0
    src = {k: v.detach().float() for k, v in lm.state_dict().items()}
    E = src["model.embed_tokens.weight"]
    P = torch.linalg.qr(E[list(token_ids)].T)[0].T.contiguous()  # [r, H0], orthonormal rows
    r = P.shape[0]
    if 2 * r + 3 > H - H0 or r >= hd or 2 * r > a0.intermediate_size:
        raise ValueError(f"{r} response tokens: too many for hidden {H0}, head size {hd}")
    C, A = slice(H0, H0 + r), slice(H0 + r, H0 + 2 * r)
    Z, K, S = H0 + 2 * r, H0 + 2 * r + 1, H0 + 2 * r + 2
    hf = hf_config_for(lm)
    hf.update(hidden_size=H, num_hidden_layers=L0 + 2, max_window_layers=L0 + 2, num_labels=1,
              architectures=["Qwen2ForSequenceClassification"], tie_word_embeddings=False)
    args = dataclasses.replace(a0, hidden_size=H, num_hidden_layers=L0 + 2, hf_config=hf,
                               token_classification_bias=False, tie_word_embeddings=False)
    model = Transformer(args, head="token_cls", num_labels=1)
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    s2 = math.sqrt(H / H0)
    sd["model.embed_tokens.weight"][:, :H0] = E
    sd["model.embed_tokens.weight"][:, C] = copy_scale * E @ P.T
    for k, v in src.items():
        if not k.startswith("model.layers."):
            continue
        if k.endswith("layernorm.weight"):
            sd[k][:H0] = v / s2
        elif k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k][:H0] = v
        elif k.endswith(".weight"):  # q/k/v, gate/up: [out, H0] -> [out, H]
            sd[k][:, :H0] = v
        else:  # q/k/v biases
            sd[k] = v.clone()
    # layer L0: previous-token head (query head 0 on kv head 0) + the constant
    pre = f"model.layers.{L0}."
    inv = 1.0 / (a0.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    sd[pre + "input_layernorm.weight"][:H0] = src["model.norm.weight"] / s2
    for i in range(rope_pairs):
        sd[pre + "self_attn.q_proj.bias"][i] = rope_amp * math.cos(inv[i])
        sd[pre + "self_attn.q_proj.bias"][i + hd // 2] = -rope_amp * math.sin(inv[i])
        sd[pre + "self_attn.k_proj.bias"][i] = 1.0
    sd[pre + "self_attn.v_proj.weight"][:r, :H0] = P
    sd[pre + "self_attn.v_proj.bias"][hd - 1] = 1.0
    sd[pre + "self_attn.o_proj.weight"][A, :r] = torch.eye(r)
    sd[pre + "self_attn.o_proj.weight"][K, hd - 1] = const
    # layer L0, MLP: z = sum_k A_k C_k, the RMSNorm's 1/rms^2 = H/const^2 undone by down_proj
    sd[pre + "post_attention_layernorm.weight"][A] = 1.0
    sd[pre + "post_attention_layernorm.weight"][C] = 1.0 / copy_scale
    rms2 = const * const / H
    for k in range(r):
        for row, sign in ((k, 1.0), (r + k, -1.0)):
            sd[pre + "mlp.gate_proj.weight"][row, H0 + r + k] = sign
            sd[pre + "mlp.up_proj.weight"][row, H0 + k] = sign
    sd[pre + "mlp.down_proj.weight"][Z, : 2 * r] = rms2
    # layer L0 + 1: uniform attention (query/key 0) averages z into S; the head reads S
    pre = f"model.layers.{L0 + 1}."
    sd[pre + "input_layernorm.weight"][Z] = 1.0
    sd[pre + "self_attn.v_proj.weight"][0, Z] = 1.0
    sd[pre + "self_attn.o_proj.weight"][S, 0] = math.sqrt(rms2)
    sd["model.norm.weight"][S] = 1.0
    sd["score.weight"][0, S] = math.sqrt(rms2)
    model.load_state_dict(sd)
    return model.eval()
