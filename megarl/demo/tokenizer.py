"""The demo tokenizer: a small byte-level BPE trained offline with `tokenizers`.

Pre-tokenisation isolates every "\\n\\n" (the step separator: always one token) and every digit
(numbers are spelled digit by digit), then applies GPT-2 byte-level splitting. Specials:
``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos). Saved as an HF tokenizer folder
(PreTrainedTokenizerFast) with a short ChatML-style chat template.
"""

from __future__ import annotations

import numpy as np

from megarl.demo.arith import sample_problems

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 384

_GENERAL_TEXT = [
    "Solve step by step, separating steps with a blank line, and put the final answer in "
    "\\boxed{}.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "What is the value of the expression? The answer is a whole number.",
    "The sum of two numbers is the total; the difference is what remains.",
    "First add the numbers, then subtract. Check each step before the next one.",
    "system\nYou are a helpful assistant.",
    "Let x be the number of apples. Then x + 3 = 10, so x = 7.",
]


def training_corpus(seed: int = 1234, count: int = 3000) -> list[str]:
    """Chat-formatted arith problems and solutions plus a little general text."""
    texts = []
    for p in sample_problems(seed, count, (1, 2, 3), unique=False):
        texts.append(f"user\n{p.prompt}\nassistant\n{p.solution}")
    rng = np.random.Generator(np.random.PCG64(seed))
    for _ in range(40):
        texts.extend(_GENERAL_TEXT[i] for i in rng.permutation(len(_GENERAL_TEXT)))
    return texts


def build_tokenizer(vocab_size: int = VOCAB_SIZE, seed: int = 1234):
    """Train the BPE and wrap it as a ``PreTrainedTokenizerFast`` (not yet saved)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n\n"), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD,
        extra_special_tokens=[IM_START], model_max_length=4096,
    )
    hf.chat_template = CHAT_TEMPLATE
    _check(hf)
    return hf


def _check(tok) -> None:
    for text in ("\n\n", "0", "7", "\\boxed{70}"):
        ids = tok.encode(text, add_special_tokens=False)
        if tok.decode(ids) != text:
            raise AssertionError(f"demo tokenizer does not round-trip {text!r}")
    if len(tok.encode("\n\n", add_special_tokens=False)) != 1:
        raise AssertionError("demo tokenizer: '\\n\\n' must be a single token")
    if len(tok.encode("1234567", add_special_tokens=False)) != 7:
        raise AssertionError("demo tokenizer: digits must be single tokens")


def save_tokenizer(directory: str, vocab_size: int = VOCAB_SIZE, seed: int = 1234):
    tok = build_tokenizer(vocab_size, seed)
    tok.save_pretrained(directory)
    return tok
