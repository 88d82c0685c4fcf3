"""A generative judge: a reward model served by an inference engine (verl's
``reward_model.use_reward_loop=True`` with ``reward_model.rollout.*``).

For each (question, response, ground truth) the judge renders a prompt from a template
(`megarl.judge.template`), generates a verdict with its engine (megarl's torch engine or
vLLM, on the frozen judge model ``reward_model.model.path``) and parses the verdict into a score
(`megarl.judge.parse`). Bounds on the untrusted model output:

- length: a verdict is at most ``response_length`` tokens; a rendered prompt longer than
  ``prompt_length`` tokens is not judged (score 0, counted in reward/judge_overlong_ratio);
- time: one `Judge.score` call waits at most ``timeout_s`` for the whole batch, then raises
  `JudgeTimeoutError` naming the engine, the model and the batch it waited for (the engine
  runs in this process: the late batch finishes in the background, and until it has the judge
  refuses new batches with the same error);
- content: verdicts are only scanned by the strict parsers, never evaluated; one that holds no
  verdict scores 0 and is counted in reward/judge_unparsed_ratio.

    judge = build_judge(cfg.reward_model.rollout, cfg.reward_model.model.path, seed=cfg.trainer.seed)
    scores, metrics = judge.score(prompts, responses, ground_truths)   # scores: float32 [B]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megarl.config.schema_judge import JudgeRolloutConfig
from megarl.config.schema_reward import RewardModelConfig
from megarl.errors import UserInputError
from megarl.judge.engine import (
    build_judge_engine,
    check_judge_config,
    check_model_len,
    engine_name,
)
from megarl.judge.parse import parse_verdict
from megarl.judge.template import JudgeTemplate, load_template
from megarl.rollout.protocol import Completion, RolloutEngine, SamplingParams


class JudgeTimeoutError(RuntimeError):
    """The judge's engine did not finish a batch within reward_model.rollout.timeout_s."""


class Judge:
    """Scores responses with a generative judge.

    engine: any RolloutEngine holding the judge model (never given the policy's weights).
    tokenizer: the judge model's HF tokenizer (encodes prompts, decodes verdicts).
    template: the validated judge prompt. cfg: reward_model.rollout (sampling, lengths, parser,
    timeout). seed: the sampling seed where cfg.seed is None. model_path: for messages only.

    After each `score` call ``last_verdicts`` holds each response's decoded verdict (None where
    the prompt was too long to judge) and ``last_prompts`` the rendered judge prompts.
    """

    def __init__(self, engine: RolloutEngine, tokenizer: Any, template: JudgeTemplate,
                 cfg: JudgeRolloutConfig, *, seed: int = 0, model_path: str = "") -> None:
        check_judge_config(cfg, engine=False)
        self.engine, self.tokenizer, self.template, self.cfg = engine, tokenizer, template, cfg
        self.seed = int(cfg.seed if cfg.seed is not None else seed)
        self.model_path = str(model_path)
        self.last_verdicts: list[str | None] = []
        self.last_prompts: list[str] = []
        self._pending: threading.Thread | None = None  # a generation that outlived its timeout

    # ------------------------------------------------------------------------- scoring
    def encode(self, text: str) -> list[int]:
        """Token ids of one rendered judge prompt (as one user turn when apply_chat_template
        and the tokenizer has a chat template)."""
        if self.cfg.apply_chat_template and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True)
            if isinstance(ids, Mapping):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def sampling(self) -> SamplingParams:
        """The verdicts' sampling: one per prompt, at most response_length tokens."""
        c = self.cfg
        return SamplingParams(n=1, temperature=float(c.temperature), top_k=int(c.top_k),
                              top_p=float(c.top_p), max_new_tokens=int(c.response_length),
                              seed=self.seed, greedy=not c.do_sample, logprobs=False)

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              ground_truths: Sequence[Any] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores of B responses: (float32 tensor [B], metrics).

        prompts / responses: B texts (the question as the policy saw it, the decoded
        response); ground_truths: B values or None (rendered as "" when None or absent).
        Metrics: reward/judge_score/mean (over all B), reward/judge_unparsed_ratio (share of
        judged responses whose verdict had no score), reward/judge_overlong_ratio (share not
        judged: prompt over prompt_length tokens), reward/judge_truncated_ratio (share of
        verdicts cut at response_length), reward/judge_verdict_tokens/mean, reward/judge_time_s.
        Raises JudgeTimeoutError past timeout_s."""
        t0 = time.perf_counter()
        b = len(responses)
        gts = [None] * b if ground_truths is None else list(ground_truths)
        if len(prompts) != b or len(gts) != b:
            raise ValueError(f"judge: {len(prompts)} prompts, {b} responses and {len(gts)} "
                             "ground truths; give one of each per response")
        texts = [self.template.render(p, r, g) for p, r, g in zip(prompts, responses, gts)]
        ids = [self.encode(t) for t in texts]
        judged = [i for i in range(b) if len(ids[i]) <= self.cfg.prompt_length]
        completions = self._generate([ids[i] for i in judged]) if judged else []
        verdicts: list[str | None] = [None] * b
        scores = [0.0] * b
        unparsed = truncated = tokens = 0
        for i, c in zip(judged, completions):
            verdicts[i] = self.decode(c.token_ids)
            value = parse_verdict(verdicts[i], self.cfg.score_parse, self.cfg.score_min,
                                  self.cfg.score_max)
            unparsed += value is None
            scores[i] = 0.0 if value is None else value
            truncated += c.finish_reason == "length"
            tokens += len(c.token_ids)
        self.last_verdicts, self.last_prompts = verdicts, texts
        n = max(1, len(judged))
        metrics = {
            "reward/judge_score/mean": sum(scores) / max(1, b),
            "reward/judge_unparsed_ratio": unparsed / n,
            "reward/judge_overlong_ratio": (b - len(judged)) / max(1, b),
            "reward/judge_truncated_ratio": truncated / n,
            "reward/judge_verdict_tokens/mean": tokens / n,
            "reward/judge_time_s": time.perf_counter() - t0,
        }
        return torch.tensor(scores, dtype=torch.float32), metrics

    def decode(self, token_ids: Sequence[int]) -> str:
        """A verdict's text (special tokens, the EOS that ended it included, dropped)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _generate(self, prompt_ids: list[list[int]]) -> list[Completion]:
        """The engine's verdicts for ``prompt_ids``, waited for at most timeout_s."""
        what = (f"the generative judge ({engine_name(self.engine)} engine, model "
                f"{self.model_path or '?'}) generating {len(prompt_ids)} verdicts of at most "
                f"{self.cfg.response_length} tokens")
        if self._pending is not None and self._pending.is_alive():
            raise JudgeTimeoutError(f"{what}: the engine is still busy with a batch that ran past "
                                    f"reward_model.rollout.timeout_s={self.cfg.timeout_s:g} s")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = self.engine.generate(prompt_ids, self.sampling())
            except BaseException as err:  # handed to the caller below
                box["err"] = err

        worker = threading.Thread(target=run, name="megarl-judge", daemon=True)
        worker.start()
        worker.join(self.cfg.timeout_s)
        if worker.is_alive():
            self._pending = worker
            raise JudgeTimeoutError(
                f"{what}: not done after reward_model.rollout.timeout_s={self.cfg.timeout_s:g} s "
                "(a hung engine or device, or a batch this size takes longer: then raise "
                "reward_model.rollout.timeout_s or lower reward_model.rollout.response_length)")
        if "err" in box:
            raise box["err"]
        out = box["out"]
        if len(out) != len(prompt_ids):
            raise RuntimeError(f"{what}: the engine returned {len(out)} completions")
        return sorted(out, key=lambda c: c.prompt_index)

    def close(self) -> None:
        """Release the judge's engine."""
        self.engine.close()


def build_judge(cfg: JudgeRolloutConfig, model_path: str, *, tokenizer_path: str | None = None,
                device: torch.device | str = "cpu", seed: int = 0) -> Judge:
    """The judge of ``reward_model.rollout`` (``cfg``) on the judge model ``model_path``
    (``reward_model.model.path``: an HF folder, hub id or embedded://NAME) and its tokenizer
    (``tokenizer_path``, default the model's folder). Config errors are UserInputErrors naming
    the key, raised before any engine starts. seed: trainer.seed (used where cfg.seed is None)."""
    from megarl.data import load_tokenizer, resolve_path

    check_judge_config(cfg)
    template = load_template(cfg.template)
    path = resolve_path(model_path)
    check_model_len(cfg, path)
    tok_path = resolve_path(tokenizer_path) if tokenizer_path else path
    tokenizer = load_tokenizer(tok_path)
    seed = int(cfg.seed if cfg.seed is not None else seed)
    engine = build_judge_engine(cfg, path, tok_path, device, seed)
    return Judge(engine, tokenizer, template, cfg, seed=seed, model_path=path)


def is_generative(model_path: str, kind: str = "auto") -> bool:
    """Whether ``reward_model.model.path`` (a resolved folder) is served as a generative judge:
    ``reward_model.model.kind`` auto and config.json's architectures name no sequence or token
    classifier. verl's reward loop serves such classifiers too (its "disrm"): megarl scores them
    with one forward (the outcome reward model, PURE's PRM) and reads no rollout keys."""
    from megarl.models import read_hf_config
    from megarl.models.args import is_sequence_classifier

    if kind != "auto":
        return False
    hf = read_hf_config(model_path)
    token = any(str(a).endswith("ForTokenClassification") for a in hf.get("architectures") or ())
    return not (is_sequence_classifier(hf) or token)


def judge_from_section(rm: RewardModelConfig, seed: int,
                       device: torch.device | str = "cpu") -> Judge | None:
    """The run's judge from its ``reward_model`` section ``rm`` (its rollout, model.path and
    model.kind; ``seed``: trainer.seed), or None when it has none: on iff
    ``reward_model.use_reward_loop``, ``reward_model.rollout.name`` is set and the model is
    generative (`is_generative`). The judge model's tokenizer is its own folder's."""
    from megarl.config.schema_judge import judge_enabled
    from megarl.data import resolve_path

    if not judge_enabled(rm):
        return None
    if not rm.model.path:
        raise UserInputError(
            "reward_model.use_reward_loop=true with reward_model.rollout.name="
            f"{rm.rollout.name} serves a generative judge, but reward_model.model.path is not "
            "set. Fix: point it at the judge model (an HF folder or hub id), or unset "
            "reward_model.rollout.name")
    if not is_generative(resolve_path(rm.model.path), getattr(rm.model, "kind", "auto")):
        return None
    return build_judge(rm.rollout, rm.model.path, device=device, seed=seed)
