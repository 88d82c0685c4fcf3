"""The demo tokenizer: digits and "\\n\\n" are single tokens; text round-trips."""

import numpy as np

from megarl.demo import arith
from megarl.demo.tokenizer import CHAT_TEMPLATE, VOCAB_SIZE


def test_specials_and_size(tok):
    assert len(tok) <= VOCAB_SIZE
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert ids == [0, 1, 2]
    assert tok.chat_template == CHAT_TEMPLATE


def test_digits_are_single_tokens(tok):
    rng = np.random.default_rng(0)
    for n in rng.integers(0, 10**9, size=200):
        s = str(int(n))
        ids = tok.encode(s, add_special_tokens=False)
        assert [tok.decode([i]) for i in ids] == list(s)
    for context in ("x=12+345", " 7 ", "\\boxed{90}"):
        pieces = [tok.decode([i]) for i in tok.encode(context, add_special_tokens=False)]
        assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))


def test_double_newline_is_one_token(tok):
    sep = tok.encode("\n\n", add_special_tokens=False)
    assert len(sep) == 1
    for p in arith.sample_problems(2, 50, (1, 2, 3)):
        ids = tok.encode(p.solution, add_special_tokens=False)
        assert ids.count(sep[0]) == len(p.ops)  # one separator token between steps
    ids = tok.encode("a\n\n\n\nb", add_special_tokens=False)
    assert ids.count(sep[0]) == 2


def test_round_trip(tok):
    texts = [p.solution for p in arith.sample_problems(3, 50, (1, 2, 3))]
    texts += ["Hello, world! Ünïcødé 中文 ∑ x^2", "  spaces\tand\nnewlines\n\n\n", "$\\frac{1}{2}$"]
    for t in texts:
        assert tok.decode(tok.encode(t, add_special_tokens=False)) == t


def test_prompt_is_short(tok):
    p = arith.sample_problems(0, 1, 3)[0]
    text = tok.apply_chat_template([{"role": "user", "content": p.prompt}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert 20 <= len(tok.encode(text, add_special_tokens=False)) <= 30
