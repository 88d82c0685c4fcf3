"""The demo PRM: a 2-label token classifier trained on automatically labelled arith steps.

Data. Each example is a problem's reference solution, clean or corrupted (``arith.corrupt_
solution``: a wrong result carried forward, a wrong result followed by the right values, a
wrong copied operand / operator, a wrong or premature boxed answer). Step labels come from
``arith.label_steps`` (1 = the step matches the reference and all earlier steps do; every
step after the first error is 0), so a PRM that says "correct" after an error is wrong even
when that later step's own arithmetic is right: it has to notice that the running value no
longer follows from the problem.

Input/labels. The sequence is exactly what the trainer scores: chat-templated prompt (left
padding) + response tokens + ``<|im_end|>`` (right padding). Labels sit at the step-end
positions given by ``megarl.data.build_prm_inputs`` (every "\\n\\n" token and the last response
token), the same function the PRM role calls at RL time, so training and inference agree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from megarl.data.batching import pad_left, pad_right
from megarl.data.steps import build_prm_inputs
from megarl.data.tokenizer import render_prompt
from megarl.demo.arith import SEP, Problem, corrupt_solution, label_steps


@dataclass
class PRMExample:
    prompt_ids: list[int]
    response_ids: list[int]  # steps joined by "\n\n", then eos
    labels: list[int]  # one per step
    kind: str = "clean"
    token_labels: list[int] | None = None  # one per response token (see prefix_labels)


def prefix_labels(response_ids: Sequence[int], reference_ids: Sequence[int]) -> list[int]:
    """1 at token t while ``response_ids[:t+1]`` is a prefix of the reference, then 0.

    At a step end this equals the step label (all steps so far equal the reference steps,
    separators included), so it is a dense version of the same target: the PRM is also told
    at which token the solution left the correct path.
    """
    out, ok = [], True
    for t, tok in enumerate(response_ids):
        ok = ok and t < len(reference_ids) and int(tok) == int(reference_ids[t])
        out.append(int(ok))
    return out


def step_texts(response_ids: Sequence[int], tokenizer, step_end_ids: Sequence[int]) -> list[str]:
    """The text of each step of one response, split where ``build_prm_inputs`` puts step ends
    (separator tokens and the last token), separator and special tokens removed."""
    ends = set(int(i) for i in step_end_ids)
    steps, start = [], 0
    for j, t in enumerate(response_ids):
        if int(t) in ends or j == len(response_ids) - 1:
            text = tokenizer.decode(list(response_ids[start : j + 1]), skip_special_tokens=True)
            steps.append(text.removesuffix(SEP))
            start = j + 1
    return steps


def make_example(problem: Problem, steps: list[str], tokenizer, kind: str = "clean"
                 ) -> PRMExample:
    prompt = render_prompt(tokenizer, [{"role": "user", "content": problem.prompt}])
    p_ids = tokenizer.encode(prompt, add_special_tokens=False)
    r_ids = _response_ids(steps, tokenizer)
    ref = _response_ids(problem.steps(), tokenizer)
    return PRMExample(p_ids, r_ids, label_steps(problem, steps), kind, prefix_labels(r_ids, ref))


def _response_ids(steps: list[str], tokenizer) -> list[int]:
    return tokenizer.encode(SEP.join(steps), add_special_tokens=False) + [tokenizer.eos_token_id]


def make_examples(problems: Sequence[Problem], tokenizer, seed: int) -> list[PRMExample]:
    """One clean-or-corrupted solution per problem (see ``arith.corrupt_solution``)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    out = []
    for p in problems:
        steps, _, kind = corrupt_solution(p, rng)
        out.append(make_example(p, steps, tokenizer, kind))
    return out


def prm_batch(examples: Sequence[PRMExample], pad_id: int, step_end_ids: Sequence[int],
              dense: bool = False):
    """(input_ids [B, P+L], attention_mask [B, P+L], labels [B, L]) in the SequenceBatch layout;
    labels hold the step label at each step end (from ``build_prm_inputs``), -100 elsewhere.
    dense=True: labels hold ``token_labels`` on every response token instead (their values at
    the step ends are checked to equal the step labels)."""
    p_ids, p_mask = pad_left([e.prompt_ids for e in examples], pad_id)
    r_ids, r_mask = pad_right([e.response_ids for e in examples], pad_id)
    ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
    L = r_ids.shape[1]
    step_mask = build_prm_inputs(ids, mask, L, list(step_end_ids)).step_mask
    labels = torch.full((len(examples), L), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        pos = torch.nonzero(step_mask[i]).squeeze(-1)
        if len(pos) != len(e.labels):
            raise AssertionError(
                f"example {i}: {len(pos)} step ends in tokens but {len(e.labels)} step labels"
            )
        if dense:
            if e.token_labels is None or [e.token_labels[j] for j in pos.tolist()] != e.labels:
                raise AssertionError(f"example {i}: token labels disagree with step labels")
            labels[i, : len(e.token_labels)] = torch.as_tensor(e.token_labels)
        else:
            labels[i, pos] = torch.as_tensor(e.labels)
    return ids, mask, labels


def prm_logits(model, ids: torch.Tensor, mask: torch.Tensor, response_length: int):
    """[B, L, 2] token-classification logits of the response columns."""
    return model(ids, attention_mask=mask)[:, -response_length:]


def train_prm(
    model, examples: Sequence[PRMExample], pad_id: int, step_end_ids: Sequence[int],
    steps: int, batch_size: int = 64, lr: float = 1e-3, warmup: int = 20, seed: int = 0,
    log: Callable[[str], None] | None = None, dense: bool = True,
) -> float:
    """AdamW on the mean cross-entropy over every response token's prefix label (dense=True)
    or over the step ends only. Returns seconds spent."""
    rng = np.random.Generator(np.random.PCG64(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)))
    model.train()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        batch = [examples[i] for i in rng.integers(len(examples), size=batch_size)]
        ids, mask, labels = prm_batch(batch, pad_id, step_end_ids, dense)
        logits = prm_logits(model, ids, mask, labels.shape[1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log and (step % 100 == 0 or step == steps):
            log(f"  prm step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
    return time.perf_counter() - t0


@torch.no_grad()
def evaluate_prm(model, examples: Sequence[PRMExample], pad_id: int,
                 step_end_ids: Sequence[int], batch_size: int = 256) -> dict[str, float]:
    """Step accuracy (argmax label at each step end), split by true label, and the share of
    responses whose first wrong step is found exactly (first predicted 0 = first true 0)."""
    was = model.training
    model.eval()
    hits = {0: [0, 0], 1: [0, 0]}
    first_ok, n_wrong_resp = 0, 0
    for s in range(0, len(examples), batch_size):
        chunk = examples[s : s + batch_size]
        ids, mask, labels = prm_batch(chunk, pad_id, step_end_ids)
        pred = prm_logits(model, ids, mask, labels.shape[1]).argmax(-1)
        for i in range(len(chunk)):
            at = labels[i] != -100
            y, p = labels[i][at].tolist(), pred[i][at].tolist()
            for yy, pp in zip(y, p):
                hits[yy][0] += int(yy == pp)
                hits[yy][1] += 1
            if 0 in y:
                n_wrong_resp += 1
                first_ok += int(0 in p and p.index(0) == y.index(0))
    model.train(was)
    total = hits[0][1] + hits[1][1]
    return {
        "step_accuracy": (hits[0][0] + hits[1][0]) / max(total, 1),
        "accuracy_on_correct_steps": hits[1][0] / max(hits[1][1], 1),
        "accuracy_on_wrong_steps": hits[0][0] / max(hits[0][1], 1),
        "first_error_found": first_ok / max(n_wrong_resp, 1),
        "num_steps": total,
    }
