"""Outcome reward model: one score per whole response, as verl's ``reward_model.enable``.

The model is an HF ``*ForSequenceClassification`` checkpoint (Skywork-Reward, FsfairX-LLaMA3-RM:
``score = Linear(hidden, 1, bias=False)``) run by the ``prm`` role's backend: its score head over
the hidden states, read at the LAST token of prompt + response (the response's EOS when it has
one), as transformers' sequence classifier and verl's ``RewardModelWorker`` read it.

Its input is the policy's own token ids when the RM's tokenizer is the policy's (same vocabulary
and chat template); otherwise each response is decoded, the RM's chat template renders the
prompt's messages plus ``{"role": "assistant", "content": response}``, and the RM's tokenizer
encodes that (verl's ``_switch_chat_template``; longer inputs are cut at the right to
``reward_model.max_length`` tokens).

The score replaces the rule reward of the reward manager as the training reward, as verl's reward
managers return ``rm_scores`` unchanged when present; the rule reward is still computed and
logged (``reward/score/*``), and validation scores with the rule reward (verl validates on
rule-based rewards only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.backends.protocol import Backend, SequenceBatch
from megarl.errors import UserInputError
from megarl.metrics import Metric
from megarl.models.args import is_sequence_classifier

log = logging.getLogger(__name__)

KINDS = ("auto", "prm", "outcome")


def reward_model_kind(kind: str, hf_config: dict[str, Any], path: str) -> str:
    """"prm" or "outcome": ``reward_model.model.kind`` checked against the checkpoint's
    config.json ``architectures`` (``auto``: decided by them)."""
    if kind not in KINDS:
        raise UserInputError(f"reward_model.model.kind={kind!r}: expected one of {KINDS}")
    arch = list(hf_config.get("architectures") or [])
    seq = is_sequence_classifier(hf_config)
    tok = any(str(a).endswith("ForTokenClassification") for a in arch)
    found = "outcome" if seq else "prm" if tok else None
    if kind == "auto":
        if found is None:
            raise UserInputError(
                f"reward_model.model.path={path}: config.json architectures {arch} name neither "
                "a *ForSequenceClassification (an outcome reward model) nor a "
                "*ForTokenClassification (a process reward model); set "
                "reward_model.model.kind=outcome or prm to say which this checkpoint is")
        return found
    if found is not None and found != kind:
        what = "a *ForSequenceClassification" if seq else "a *ForTokenClassification"
        raise UserInputError(
            f"reward_model.model.kind={kind} but reward_model.model.path={path} is {what} "
            f"checkpoint ({arch}), i.e. a{'n outcome' if seq else ' process'} reward model; set "
            f"reward_model.model.kind={found} (or auto)")
    return kind


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether ids of tokenizer ``a`` mean the same to ``b`` and the chat templates agree."""
    return (a.get_vocab() == b.get_vocab()
            and getattr(a, "chat_template", None) == getattr(b, "chat_template", None))


def last_token_layout(rows: Sequence[Sequence[int]], pad_id: int) -> SequenceBatch:
    """The sequences ``rows`` (each >= 1 token) as a batch whose one response column is each
    row's last token: prompt = row[:-1] left-padded, response = row[-1:]. The backend's
    ``token_scores`` of it is then [B, 1, labels], the score head at each last token."""
    if any(len(r) == 0 for r in rows):
        raise ValueError("an outcome reward model input has no tokens")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
        mask[i, width - len(r):] = 1
    return SequenceBatch(ids, mask, 1)


@dataclass
class OutcomeRewardModel:
    """Scores whole responses with a sequence-classifier reward model.

    backend:          the ``prm`` role's backend over the RM checkpoint (1-label ``score``)
    policy_tokenizer: the tokenizer of the rollout's ids
    rm_tokenizer:     the RM's own tokenizer when its input is re-rendered, else None (the RM
                      reads the policy's ids)
    max_length:       TOKENS a re-rendered input keeps (cut at the right)
    """

    backend: Backend
    policy_tokenizer: Any
    rm_tokenizer: Any = None
    max_length: int | None = None

    @property
    def rerenders(self) -> bool:
        return self.rm_tokenizer is not None

    def inputs(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
               messages: Sequence[list[dict[str, Any]] | None] | None = None) -> list[list[int]]:
        """The RM's input ids of each (prompt, response): the policy's ids concatenated, or,
        re-rendering, the RM's chat template over ``messages`` (the prompt's chat messages)
        plus the decoded response."""
        if not self.rerenders:
            return [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        if messages is None or any(m is None for m in messages):
            raise UserInputError(
                "reward_model.model.path: the outcome reward model's tokenizer differs from the "
                "policy's, so its input is re-rendered from the prompt's chat messages, which "
                "this step does not have (a greedy baseline of ReMax); use an RM with the "
                "policy's tokenizer")
        src, rm = self.policy_tokenizer, self.rm_tokenizer
        out = []
        for chat, resp in zip(messages, response_ids):
            text = src.decode(list(resp))
            if src.eos_token:
                text = text.replace(src.eos_token, "")
            convo = [dict(m) for m in chat] + [{"role": "assistant", "content": text}]
            rendered = rm.apply_chat_template(convo, add_generation_prompt=False, tokenize=False)
            ids = rm(rendered, add_special_tokens=False)["input_ids"]
            if self.max_length is not None:
                ids = ids[: self.max_length]
            out.append(list(ids))
        return out

    def score(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
              messages: Sequence[list[dict[str, Any]] | None] | None = None) -> torch.Tensor:
        """[B] float32: the RM's score head at the last token of each prompt + response
        (collective: every rank calls it with the same rows)."""
        rows = self.inputs(prompt_ids, response_ids, messages)
        pad = self.rm_tokenizer.pad_token_id if self.rerenders else self.policy_tokenizer.pad_token_id
        batch = last_token_layout(rows, 0 if pad is None else pad)
        scores = self.backend.token_scores(batch)  # [B, 1, 1]
        return scores[:, 0, 0].to(torch.float32).cpu()


def load_rm_tokenizer(rm_path: str, input_tokenizer: str | None, policy_tokenizer: Any) -> Any:
    """The RM's tokenizer when its input must be re-rendered, else None. ``input_tokenizer``
    set (verl's ``reward_model.model.input_tokenizer``): always re-render; unset: re-render iff
    the RM folder's tokenizer differs from the policy's (vocabulary or chat template); an RM
    folder without a tokenizer reads the policy's ids."""
    import os

    from megarl.data import load_tokenizer, resolve_path

    local = resolve_path(rm_path)
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if os.path.isdir(local) and not any(os.path.exists(os.path.join(local, f)) for f in files):
        if input_tokenizer:
            raise UserInputError(
                "reward_model.model.input_tokenizer is set, so the outcome reward model's input "
                f"is re-rendered with its own tokenizer, but reward_model.model.path={rm_path} "
                "has none; add the RM's tokenizer files or unset input_tokenizer")
        return None
    rm_tok = load_tokenizer(rm_path)
    if not input_tokenizer and same_tokenizer(rm_tok, policy_tokenizer):
        return None
    if not getattr(rm_tok, "chat_template", None):
        raise UserInputError(
            f"reward_model.model.path={rm_path}: the outcome reward model's tokenizer differs "
            "from the policy's, so responses are re-rendered with its chat template, and it has "
            "none; add a chat_template to its tokenizer_config.json")
    return rm_tok


def score_samples(orm: OutcomeRewardModel, samples: Sequence[Any],
                  messages: Sequence[list[dict[str, Any]] | None] | None = None,
                  ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """(scores [len(samples)] float32, {"reward/rm_score/mean": MEAN over the samples}) of
    rollout samples (``.prompt_ids``, ``.response_ids``); ``messages``: each sample's prompt
    chat messages (needed when the RM re-renders its input)."""
    scores = orm.score([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                       messages)
    n = len(samples)
    mean = float(scores.mean()) if n else 0.0
    return scores, {"reward/rm_score/mean": Metric.mean(mean, n)}


def prompt_messages(samples: Sequence[Any], items: Sequence[Any],
                    group_offset: int) -> list[list[dict[str, Any]] | None]:
    """Each sample's prompt chat messages: ``raw_prompt`` of its dataset item (group id -
    ``group_offset`` = the item's position in ``items``; None where an item has none)."""
    return [getattr(items[s.group - group_offset], "raw_prompt", None) for s in samples]
