"""What the GPU check's steps share (bench/gpu_check.py): the two sets of shapes, the
failure type that keeps a step's measurements, the run folder's layout, loading the model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHAR_IDS = 100  # the test tokenizer's ids (megarl.models.testing.make_tiny_tokenizer)


@dataclass(frozen=True)
class Sizes:
    """Shapes of one run of the check: the GPU's, or the dry run's on the CPU."""

    device: str
    dtype: str  # "bf16" | "fp32" (the training and engine dtype)
    kernel_shapes: tuple[tuple[int, int, int], ...]  # (T, H, V)
    bench_tokens: tuple[int, ...]
    bench_hv: tuple[int, int]
    model: dict
    prompts: int  # per step
    n: int  # responses per prompt
    response_len: int
    steps: int
    gen_batch: int
    gen_len: int
    gen_repeats: int
    logprob_gap_bound: float  # mean |engine - trainer| logprob at step 1 (see _gap_bound)


GPU = Sizes(
    device="cuda", dtype="bf16",
    kernel_shapes=((300, 96, 1031), (2048, 896, 151936)),
    bench_tokens=(4096, 16384), bench_hv=(896, 151936),
    model=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
               max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6),
    prompts=16, n=4, response_len=256, steps=4, gen_batch=64, gen_len=256, gen_repeats=2,
    logprob_gap_bound=0.02,
)
DRY = Sizes(
    device="cpu", dtype="fp32",
    kernel_shapes=((37, 48, 517),),
    bench_tokens=(64,), bench_hv=(32, 1000),
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
               max_position_embeddings=512, tie_word_embeddings=True),
    prompts=2, n=2, response_len=16, steps=2, gen_batch=4, gen_len=16, gen_repeats=1,
    logprob_gap_bound=1e-4,
)


class CheckFailed(AssertionError):
    """A step ran but its result is outside its bound; ``result`` keeps what it measured."""

    def __init__(self, what: str, result: dict | None = None):
        super().__init__(what)
        self.result = result


def require(ok: bool, what: str, result: dict | None = None) -> None:
    if not ok:
        raise CheckFailed(what, result)


def work_dir(out: Path) -> Path:
    path = out / "work"
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_dir(out: Path) -> Path:
    return work_dir(out) / "qwen2_random"


def load_hf(path: Path, dtype, device):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if device == "meta":
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
