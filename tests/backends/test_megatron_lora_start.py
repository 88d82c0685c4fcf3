"""How the megatron actor's LoRA adapters start (TP = PP = 1, this process): verl's
``lora_A_init_method`` / ``lora_B_init_method`` draws have their textbook spreads on every
adapter, and ``lora_adapter_path`` (a PEFT folder made with peft, B != 0) gives, in float64,
the logits of megatron's own layers holding PEFT's merged weights (within 1e-9) and of
``peft.PeftModel.from_pretrained`` on transformers (within the two base models' gap)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mcore_testlib as lib  # noqa: E402
from test_megatron_lora import _float64_chunk  # noqa: E402

from megarl.models.testing import save_random_peft_adapter  # noqa: E402

F64 = torch.float64


def _forward(chunk, ids):
    from megarl.backends.megatron import cpu_compat

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with cpu_compat.cuda_to_cpu(), torch.no_grad():
        hidden = chunk(ids, pos, None)  # [s, b, h]
        return (hidden @ chunk.lm_head_weight().t()).transpose(0, 1)


def _setup(tmp_path):
    from megarl.backends.megatron import parallel
    from megarl.backends.megatron.model import Layout
    from megarl.models.args import ModelArgs
    from megarl.models.hf_io import read_hf_config

    lib.ensure_dist()
    parallel.reset_model_parallel()
    parallel.ensure_model_parallel(1, 1, seed=1)
    path = lib.make_model(tmp_path / "qwen2", "qwen2", "lm", num_key_value_heads=2,
                          num_attention_heads=4, tie_word_embeddings=False)
    return path, ModelArgs.from_hf_config(read_hf_config(path)), Layout()


def test_init_methods_spread(tmp_path):
    """A xavier: std sqrt(2 / (in + r)) per adapter; B normal: std 0.2; every adapter its own
    draw. Planted: the kaiming draw kept for A (std 1/sqrt(3 in)) or B left at zero fails."""
    from megarl.backends.megatron import parallel
    from megarl.backends.megatron.lora import install
    from megarl.models.lora import LoraSettings

    path, args, layout = _setup(tmp_path)
    chunk = _float64_chunk(path, args, layout)
    r = 16
    settings = LoraSettings(rank=r, alpha=32.0, init_a="xavier", init_b="normal")
    specs = install([chunk], args, layout, settings, seed=1)
    a_all = [chunk.lora.pairs[s.key].lora_A.detach() for s in specs]
    for s, a in zip(specs, a_all):
        b = chunk.lora.pairs[s.key].lora_B.detach()
        assert abs(float(a.std()) / math.sqrt(2 / (s.in_features + r)) - 1) < 0.1, s.module
        assert abs(float(b.std()) / 0.2 - 1) < 0.1, s.module
    assert not torch.equal(a_all[0], a_all[1])
    parallel.reset_model_parallel()


def test_adapter_path_gives_peft_logits(tmp_path):
    """Planted: the folder's alpha ignored (the config's 16), q and v adapters swapped inside
    the fused qkv, or the folder not read: logits off by > 1e-2."""
    import peft
    import transformers

    from megarl.backends.megatron import parallel
    from megarl.backends.megatron.lora import adapters_disabled, install
    from megarl.models.lora import adapter_settings

    path, args, layout = _setup(tmp_path)
    _, g = save_random_peft_adapter(path, tmp_path / "adapter", ["q_proj", "v_proj", "up_proj"])
    ids = torch.randint(3, args.vocab_size, (2, 9), generator=g)
    ref = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64), tmp_path / "adapter")
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=torch.arange(9).expand(2, 9)).logits
    ref.merge_and_unload().save_pretrained(tmp_path / "merged")

    settings = adapter_settings(tmp_path / "adapter", 0, 16.0)
    chunk = _float64_chunk(path, args, layout)
    specs = install([chunk], args, layout, settings, seed=1)
    assert len(specs) == 3 * args.num_hidden_layers
    got = _forward(chunk, ids)
    merged = _forward(_float64_chunk(tmp_path / "merged", args, layout), ids)
    assert (got - merged).abs().max() <= 1e-9
    assert (got - want).abs().max() <= 5e-6 * want.abs().max()
    with adapters_disabled([chunk]):
        assert (_forward(chunk, ids) - want).abs().max() > 1e-2
    parallel.reset_model_parallel()
