"""RLDataset: prompts in verl's row format, tokenised once through the chat template (a large
file's load cached on disk: megarl.data.prompt_cache, its ids: megarl.data.token_cache)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.data import prompt_cache
from megarl.data.locations import resolve_path
from megarl.data.rows import BadRowError, read_rows, validate_row
from megarl.data.token_cache import token_ids
from megarl.data.tokenizer import chat_template_kwargs as checked_template_kwargs
from megarl.data.tokenizer import render_prompt
from megarl.errors import UserInputError

logger = logging.getLogger(__name__)

TRUNCATION = ("error", "filter", "left", "right")


@dataclass
class PromptItem:
    """One prompt ready for rollout.

    prompt_ids:   token ids of the rendered prompt (chat template applied), at most
                  max_prompt_length long
    raw_prompt:   the chat messages as stored in the row
    data_source:  the row's data_source (the reward function is chosen by it)
    ground_truth: reward_model.ground_truth (a string, or a list of strings)
    extra_info:   the row's extra_info dict ({} when absent)
    index:        the row's position in the concatenation of all files, counted before
                  filtering (a stable id for logging and grouping)
    prompt_text:  the rendered prompt text (after the chat template, before truncation)
    """

    prompt_ids: list[int]
    raw_prompt: list[dict[str, str]]
    data_source: str
    ground_truth: str | list[str]
    extra_info: dict[str, Any]
    index: int
    prompt_text: str = field(default="", repr=False)


class RLDataset:
    """All rows of ``files``, validated and tokenised at construction.

    Args:
        files: one path or a list of paths (.parquet / .jsonl / .json) or ``embedded://...``
        tokenizer: an HF tokenizer (see ``load_tokenizer``)
        max_prompt_length: prompts longer than this (in tokens) are dropped when
            ``filter_overlong_prompts`` (``num_filtered``, logged), else handled by
            ``truncation``: "error" raises naming file and row, "filter" drops them too,
            "left" keeps the last max_prompt_length tokens, "right" keeps the first.
        filter_overlong_prompts: drop over-long prompts at load (verl's data key)
        prompt_key: the row field holding the chat messages
        chat_template: a Jinja template used instead of the tokenizer's own
        apply_chat_template: False feeds the message text without any template
        on_bad_row: "error" raises on a malformed row; "skip" drops it (``num_bad_rows``, logged)
        tools: OpenAI function schemas rendered into every prompt by the chat template
            (multi-turn rollouts with tools; None: none)
        chat_template_kwargs: extra variables the chat template reads
            (``data.apply_chat_template_kwargs``: ``enable_thinking``, ``reasoning_effort``, ...)
    """

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: str = "error",
        chat_template: str | None = None,
        apply_chat_template: bool = True,
        on_bad_row: str = "error",
        filter_overlong_prompts: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        files = [files] if isinstance(files, str) else list(files)
        if not files:
            raise ValueError("RLDataset needs at least one data file")
        self._setup([resolve_path(f) for f in files], tokenizer, max_prompt_length, truncation,
                    on_bad_row, filter_overlong_prompts, tools, chat_template_kwargs)
        settings = {"prompt_key": prompt_key, "on_bad_row": on_bad_row,
                    "max_prompt_length": max_prompt_length, "truncation": truncation,
                    "filter_overlong_prompts": filter_overlong_prompts,
                    "apply_chat_template": apply_chat_template, "tools": tools,
                    "chat_template_kwargs": self.chat_template_kwargs}
        key = prompt_cache.cache_key(self.files, tokenizer, settings, chat_template)
        cached = prompt_cache.load(key) if key is not None else None
        if cached is not None:
            self._restore(cached)
            return
        bad_examples = self._ingest([(path, read_rows(path, on_bad_row)) for path in self.files],
                                    prompt_key, on_bad_row, chat_template, apply_chat_template)
        if key is not None:
            prompt_cache.save(key, self._cached(bad_examples))

    @classmethod
    def from_rows(cls, name: str, rows: Sequence[dict], tokenizer, max_prompt_length: int,
                  prompt_key: str = "prompt", truncation: str = "error",
                  chat_template: str | None = None, apply_chat_template: bool = True,
                  on_bad_row: str = "error", filter_overlong_prompts: bool = False,
                  tools: list[dict] | None = None,
                  chat_template_kwargs: dict[str, Any] | None = None) -> RLDataset:
        """The same dataset from rows already in memory (e.g. those of a user's dataset class,
        ``data.custom_cls``); ``name`` stands for the file in messages and ``files``."""
        self = cls.__new__(cls)
        self._setup([name], tokenizer, max_prompt_length, truncation, on_bad_row,
                    filter_overlong_prompts, tools, chat_template_kwargs)
        self._ingest([(name, iter(enumerate(rows)))], prompt_key, on_bad_row, chat_template,
                     apply_chat_template)
        return self

    def _cached(self, bad_examples: list[str]) -> prompt_cache.CachedLoad:
        rows = [[it.raw_prompt, it.data_source, it.ground_truth, it.extra_info, it.index,
                 it.prompt_text] for it in self.items]
        return prompt_cache.CachedLoad([it.prompt_ids for it in self.items], rows,
                                       self._counts(), bad_examples)

    def _counts(self) -> dict[str, int]:
        return {"num_bad_rows": self.num_bad_rows, "num_filtered": self.num_filtered,
                "num_truncated": self.num_truncated}

    def _restore(self, cached: prompt_cache.CachedLoad) -> None:
        """The items and counts of an earlier load of the same files and settings."""
        self.items = [PromptItem(ids, raw, source, truth, extra, index, text)
                      for ids, (raw, source, truth, extra, index, text)
                      in zip(cached.ids, cached.rows)]
        for name in self._counts():
            setattr(self, name, int(cached.counts.get(name, 0)))
        self._report(cached.bad_examples)

    def _setup(self, files: list[str], tokenizer, max_prompt_length: int, truncation: str,
               on_bad_row: str, filter_overlong_prompts: bool, tools: list[dict] | None,
               chat_template_kwargs: dict[str, Any] | None = None) -> None:
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        self.files = files
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.tools = tools
        self.chat_template_kwargs = checked_template_kwargs(chat_template_kwargs)
        self.num_filtered = 0
        self.num_bad_rows = 0
        self.num_truncated = 0
        self.items: list[PromptItem] = []

    def _ingest(self, sources, prompt_key: str, on_bad_row: str, chat_template: str | None,
                apply_chat_template: bool) -> list[str]:
        """Validate, render and tokenise the rows of each ``(name, iterator of (row index,
        row or BadRowError))`` source, in order; a row's ``index`` counts across sources.
        Returns the first bad rows' messages (logged)."""
        bad_examples: list[str] = []
        offset = 0
        for path, source in sources:
            rows, where, n_rows = [], [], 0
            for i, row in source:
                n_rows = i + 1
                try:
                    if isinstance(row, BadRowError):
                        raise row
                    rows.append(validate_row(path, i, row, prompt_key))
                    where.append(i)
                except BadRowError as e:
                    if on_bad_row == "error":
                        raise
                    self.num_bad_rows += 1
                    if len(bad_examples) < 3:
                        bad_examples.append(str(e).split(". Fix the row")[0])
            self._add_file(path, rows, where, offset, chat_template, apply_chat_template)
            offset += n_rows
        self._report(bad_examples)
        return bad_examples

    def _report(self, bad_examples: list[str]) -> None:
        """Logs the load's counts; raises when no prompt is left."""
        max_prompt_length, truncation = self.max_prompt_length, self.truncation
        if self.num_bad_rows:
            logger.warning(
                "skipped %d malformed rows (on_bad_row=skip), e.g.: %s",
                self.num_bad_rows, "; ".join(bad_examples),
            )
        if self.num_filtered:
            logger.warning(
                "filtered %d prompts longer than max_prompt_length=%d tokens (%s)",
                self.num_filtered, max_prompt_length,
                "filter_overlong_prompts" if self.filter_overlong_prompts else "truncation=filter",
            )
        if self.num_truncated:
            logger.info(
                "truncated %d prompts to %d tokens (truncation=%s)",
                self.num_truncated, max_prompt_length, truncation,
            )
        if not self.items:
            raise UserInputError(
                f"no usable prompts in {self.files} ({self.num_bad_rows} malformed, "
                f"{self.num_filtered} over max_prompt_length={max_prompt_length})"
            )

    def _add_file(self, path, rows, where, offset, chat_template, apply_chat_template) -> None:
        texts = [
            render_prompt(self.tokenizer, r["prompt"], apply_chat_template, chat_template,
                          self.tools, self.chat_template_kwargs)
            for r in rows
        ]
        if not texts:
            return
        # the tokenizer's output, or the same ids from the on-disk cache (token_cache)
        ids_list = token_ids(self.tokenizer, texts, add_special_tokens=False)
        limit = self.max_prompt_length
        for r, i, text, ids in zip(rows, where, texts, ids_list):
            ids = list(ids)
            if len(ids) > limit:
                if self.filter_overlong_prompts or self.truncation == "filter":
                    self.num_filtered += 1
                    continue
                if self.truncation == "error":
                    raise UserInputError(
                        f"{path}: row {i}: prompt is {len(ids)} tokens, over "
                        f"max_prompt_length={limit}. Raise data.max_prompt_length, set "
                        f"data.filter_overlong_prompts=true (drop), or data.truncation to "
                        f"'left' or 'right' (cut)"
                    )
                self.num_truncated += 1
                ids = ids[-limit:] if self.truncation == "left" else ids[:limit]
            self.items.append(
                PromptItem(
                    prompt_ids=ids,
                    raw_prompt=r["prompt"],
                    data_source=r["data_source"],
                    ground_truth=r["ground_truth"],
                    extra_info=r["extra_info"],
                    index=offset + i,
                    prompt_text=text,
                )
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    @property
    def prompt_lengths(self) -> list[int]:
        """Token count of every prompt, in dataset order."""
        return [len(it.prompt_ids) for it in self.items]
