"""Prompt data: verl-format datasets, chat templates, sampling, padding, micro-batching, steps."""

from megarl.data.batching import needed_micro_batches, pad_left, pad_right, split_by_token_budget
from megarl.data.dataset import TRUNCATION, PromptItem, RLDataset
from megarl.data.locations import register_scheme, resolve_path
from megarl.data.rows import BadRowError, read_rows, validate_row, write_rows
from megarl.data.sampler import PromptSampler
from megarl.data.steps import PRMInputs, build_prm_inputs, step_end_mask, step_end_token_ids
from megarl.data.tokenizer import load_tokenizer, render_prompt

__all__ = [
    "TRUNCATION",
    "BadRowError",
    "PRMInputs",
    "PromptItem",
    "PromptSampler",
    "RLDataset",
    "build_prm_inputs",
    "load_tokenizer",
    "needed_micro_batches",
    "pad_left",
    "pad_right",
    "read_rows",
    "render_prompt",
    "register_scheme",
    "resolve_path",
    "split_by_token_budget",
    "step_end_mask",
    "step_end_token_ids",
    "validate_row",
    "write_rows",
]
