"""PURE's reward_model keys reach the PRM input with PURE's meaning (verl branch,
``ProcessRewardModelWorker``): steps end at tokens whose text ends with ``split_step_char``
("\\n\\n"), and the PRM reads ``step_separator`` ("\\n") at each step end. Brute force: the
response with every step-end token (each "\\n\\n" token and the final EOS, as PURE rebuilds
the input step by step) replaced by the "\\n" token. Planted: reading PURE's step_separator
as the split text (megarl's former meaning) splits at "\\n" tokens and leaves "\\n\\n"
unreplaced; the asserts fail."""

from __future__ import annotations

import pytest
import torch

from megarl.config import load_config
from megarl.data import pad_left, pad_right
from megarl.data.steps import build_prm_inputs
from megarl.trainer.prm import prm_step_settings

PURE_RM = """
data: {train_files: t.parquet, train_batch_size: 4}
actor_rollout_ref: {model: {path: m}, actor: {ppo_mini_batch_size: 4}, rollout: {n: 2}}
algorithm: {adv_estimator: pure_rloo, adv_norm: true}
reward_model:
  type: prm
  enable: true
  model: {path: prm}
  split_step_char: "\\n\\n"
  step_separator: "\\n"
"""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from megarl.demo.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def test_pure_step_keys_build_pures_prm_input(tok, tmp_path):
    (tmp_path / "pure.yaml").write_text(PURE_RM)
    cfg = load_config(str(tmp_path / "pure.yaml"))
    ends, marker = prm_step_settings(cfg.reward_model, tok)
    [nl] = tok.encode("\n", add_special_tokens=False)
    [blank] = tok.encode("\n\n", add_special_tokens=False)
    assert marker == nl and blank in ends and nl not in ends

    response = tok.encode("1+1=2\n\n2+3=5\n\n\\boxed{5}", add_special_tokens=False)
    response.append(tok.eos_token_id)
    p_ids, p_mask = pad_left([[5, 6]], tok.pad_token_id)
    r_ids, r_mask = pad_right([response], tok.pad_token_id)
    out = build_prm_inputs(torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1),
                           r_ids.shape[1], ends, replace_step_end_with=marker)
    want_ends = [t == blank for t in response[:-1]] + [True]
    # PURE: each step's end token (the final EOS too) is replaced by the separator's token
    want_ids = [nl if end else t for t, end in zip(response, want_ends)]
    assert out.input_ids[0, 2:].tolist() == want_ids
    assert out.step_mask[0].tolist() == want_ends
    assert cfg.algorithm.pure.normalize is True
