"""SFT warm start of the tiny demo policy (a Qwen2-architecture `megarl.models.Transformer`)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from megarl.data.batching import pad_right
from megarl.data.tokenizer import render_prompt
from megarl.demo.arith import Problem
from megarl.demo.greedy import greedy_generate

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def policy_config(tokenizer, vocab_size: int = 384, hidden: int = 128, layers: int = 4,
                  heads: int = 4, kv_heads: int = 2, intermediate: int = 384,
                  max_positions: int = 256) -> dict:
    """HF config.json dict of the demo policy (Qwen2, tied embeddings, ~0.84M parameters)."""
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > model vocab {vocab_size}")
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "use_cache": True,
        "torch_dtype": "float32",
    }


@dataclass
class SFTExample:
    ids: list[int]  # prompt + response + eos
    prompt_len: int


def encode_sft(prompts: Sequence[list[dict]], responses: Sequence[str], tokenizer
               ) -> list[SFTExample]:
    """Chat-template the prompts; the response is followed by the eos token."""
    texts = [render_prompt(tokenizer, m) for m in prompts]
    p_ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(list(responses), add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [SFTExample(list(p) + list(r) + [eos], len(p)) for p, r in zip(p_ids, r_ids)]


def sft_batch(examples: Sequence[SFTExample], pad_id: int):
    """(ids [B, T], labels [B, T]) right-padded; labels are the next token on response
    positions (prompt and padding: -100), so ``logits[:, t]`` predicts ``labels[:, t]``."""
    ids, mask = pad_right([e.ids for e in examples], pad_id)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, :-1][mask[:, 1:] == 0] = -100
    for i, e in enumerate(examples):
        labels[i, : e.prompt_len - 1] = -100
    return ids, labels


@dataclass
class SFTResult:
    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)


def train_sft(
    model: torch.nn.Module,
    examples: Sequence[SFTExample],
    pad_id: int,
    steps: int,
    batch_size: int = 64,
    lr: float = 2e-3,
    warmup: int = 30,
    weight_decay: float = 0.0,
    seed: int = 0,
    eval_fn: Callable[[], float] | None = None,
    eval_every: int = 100,
    eval_after: int = 0,
    stop_at: float | None = None,
    fine_eval_every: int | None = None,
    fine_below_loss: float = 0.0,
    fine_from_acc: float | None = None,
    buckets: Sequence[int] | None = None,
    log: Callable[[str], None] | None = None,
    batch_fn: Callable | None = None,
) -> SFTResult:
    """AdamW on the response tokens (loss = mean token cross-entropy), lr warmup then constant.

    Evaluation: past ``eval_after`` steps, ``eval_fn`` runs every ``eval_every`` steps, or every
    ``fine_eval_every`` once the running training loss (EMA, 0.9) is below ``fine_below_loss``
    or an eval result has reached ``fine_from_acc`` (the accuracy curve of this task is steep:
    it can go 8% -> 75% within 200 steps). Training stops at the first eval result >= ``stop_at``.
    buckets: a bucket id per example (e.g. the number of operations); each batch is drawn from
    one bucket, chosen with probability proportional to its size (same mix, no padding waste).
    batch_fn(examples, pad_id) -> (ids [B, T], labels [B, T]): None = `sft_batch`, or another
    labelling of the same shape (the tool traces' `megarl.demo.tool_sft.tool_sft_batch`).
    """
    batch_fn = batch_fn or sft_batch
    rng = np.random.Generator(np.random.PCG64(seed))
    groups = None
    if buckets is not None:
        keys = sorted(set(buckets))
        groups = [np.array([i for i, b in enumerate(buckets) if b == k]) for k in keys]
        weights = np.array([len(g) for g in groups], dtype=np.float64) / len(buckets)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98),
                            weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)))
    model.train()
    result = SFTResult(0, 0.0)
    ema = None
    fine = False
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        if groups is None:
            idx = rng.integers(len(examples), size=batch_size)
        else:
            g = groups[int(rng.choice(len(groups), p=weights))]
            idx = g[rng.integers(len(g), size=batch_size)]
        ids, labels = batch_fn([examples[i] for i in idx], pad_id)
        logits = model(ids)  # right padding + causal: padding never reaches real tokens
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        result.steps = step
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        fine = fine or ema < fine_below_loss
        every = fine_eval_every if fine_eval_every and fine else eval_every
        if eval_fn is not None and step > eval_after and step % every == 0:
            acc = eval_fn()
            model.train()
            entry = {"step": step, "loss": round(ema, 4), "acc": acc,
                     "seconds": round(time.perf_counter() - t0, 1)}
            result.history.append(entry)
            fine = fine or (fine_from_acc is not None and acc >= fine_from_acc)
            if log:
                log(f"  sft step {step}: loss {ema:.3f} dev acc {acc:.3f} "
                    f"({entry['seconds']:.0f}s)")
            if stop_at is not None and acc >= stop_at:
                break
        elif log and step % 100 == 0:
            log(f"  sft step {step}: loss {ema:.3f} ({time.perf_counter() - t0:.0f}s)")
    result.seconds = time.perf_counter() - t0
    return result


def boxed_answer(text: str) -> str | None:
    """Content of the last \\boxed{...} (no nested braces), else None."""
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None


def arith_accuracy(model, tokenizer, problems: Sequence[Problem], max_new_tokens: int = 48,
                   return_responses: bool = False):
    """Greedy exact-match accuracy of the final \\boxed{} answer."""
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": p.prompt}])
               for p in problems]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    outs = greedy_generate(model, p_ids, tokenizer.eos_token_id, tokenizer.pad_token_id,
                           max_new_tokens)
    texts = tokenizer.batch_decode(outs, skip_special_tokens=True)
    correct = [boxed_answer(t) == str(p.answer) for t, p in zip(texts, problems)]
    acc = float(np.mean(correct)) if correct else math.nan
    return (acc, texts) if return_responses else acc
