"""Step-end detection, PRM inputs, and load_tokenizer."""

import pytest
import torch

from megarl.data import (
    build_prm_inputs,
    load_tokenizer,
    pad_left,
    pad_right,
    step_end_mask,
    step_end_token_ids,
)


def test_step_end_ids_are_tokens_ending_with_separator(tok):
    ids = step_end_token_ids(tok, "\n\n")
    brute = [i for i in range(len(tok)) if tok.decode([i]).endswith("\n\n")]
    assert ids == brute and len(ids) >= 1
    assert tok.encode("\n\n", add_special_tokens=False) == [ids[0]] or len(ids) > 1
    with pytest.raises(ValueError, match="no token"):
        step_end_token_ids(tok, "@@@@")


def test_step_end_mask_and_prm_inputs(tok):
    sep = tok.encode("\n\n", add_special_tokens=False)[0]
    eos = tok.eos_token_id
    responses = [
        tok.encode("1+1=2\n\n2+3=5\n\n\\boxed{5}", add_special_tokens=False) + [eos],
        tok.encode("7\n\n", add_special_tokens=False),  # ends in a separator, no eos
        tok.encode("12", add_special_tokens=False),  # truncated: last token ends the step
    ]
    prompts = [tok.encode("a", add_special_tokens=False), [5, 6, 7], [9]]
    p_ids, p_mask = pad_left(prompts, tok.pad_token_id)
    r_ids, r_mask = pad_right(responses, tok.pad_token_id)
    L = r_ids.shape[1]
    # brute force: positions whose token is the separator, plus the last real token
    expected = torch.zeros_like(r_ids, dtype=torch.bool)
    for i, r in enumerate(responses):
        for j, t in enumerate(r):
            expected[i, j] = t == sep or j == len(r) - 1
    got = step_end_mask(r_ids, r_mask, [sep])
    assert torch.equal(got, expected)
    assert got.sum(-1).tolist() == [3, 1, 1]

    ids = torch.cat([p_ids, r_ids], 1)
    mask = torch.cat([p_mask, r_mask], 1)
    keep = build_prm_inputs(ids, mask, L, [sep])
    assert torch.equal(keep.input_ids, ids) and torch.equal(keep.step_mask, expected)
    newline = tok.encode("\n", add_special_tokens=False)[0]
    swapped = build_prm_inputs(ids, mask, L, [sep], replace_step_end_with=newline)
    resp = swapped.input_ids[:, -L:]
    assert torch.equal(resp[expected], torch.full((int(expected.sum()),), newline))
    assert torch.equal(resp[~expected], r_ids[~expected])
    assert torch.equal(swapped.input_ids[:, :-L], p_ids)
    assert torch.equal(ids[:, -L:], r_ids)  # the input was not modified in place


def test_load_tokenizer(tok_dir, tmp_path):
    t = load_tokenizer(tok_dir)
    assert t.pad_token == "<|endoftext|>" and t.eos_token == "<|im_end|>"
    with pytest.raises(FileNotFoundError, match="tokenizer folder not found"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        load_tokenizer("nobody/no-such-model-xyz")
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(NotADirectoryError):
        load_tokenizer(str(tmp_path / "f.json"))
