"""``actor_rollout_ref.actor.checkpoint.save_contents`` with "hf_model" (verl's entry): every
checkpoint holds the actor as a Hugging Face folder (``global_step_N/actor/huggingface``) that
transformers loads. Reference: transformers itself, on that folder, on the run's final
``hf_actor/`` export (the same weights at the last step) and on the initial policy (which a
trained step must differ from)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_helpers import train

from megarl.config import load_config
from megarl.config.notices import startup_notices


def _logits(folder, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.e2e
def test_every_checkpoint_holds_an_hf_model(tmp_path):
    """Planted: the HF folder written from the initial weights (model_paths alone), or at the
    wrong step, fails the step comparisons; no folder fails from_pretrained."""
    import transformers

    from megarl.data import resolve_path

    run = tmp_path / "run"
    proc = train(run, "grpo", "trainer.total_training_steps=2", "trainer.save_freq=1",
                 "trainer.export_hf=true",
                 "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    # the start-up listing of this demo run: no notice about the demo overlay's total_epochs
    # (the override sets the step count, the overlay the epochs), the critic's values named
    # once as not read by GRPO
    assert "notice: trainer.total_epochs" not in proc.stdout
    assert "set but not read by this run" in proc.stdout and "(critic.enable=false)" in proc.stdout
    steps = {n: run / "checkpoints" / f"global_step_{n}" / "actor" / "huggingface" for n in (1, 2)}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(steps[2]))
    ids = torch.tensor([tokenizer.encode("12 + 7 * 3 = ")])
    last, first = _logits(steps[2], ids), _logits(steps[1], ids)
    assert torch.equal(last, _logits(run / "hf_actor", ids))  # the final export, same weights
    init = _logits(resolve_path("embedded://policy"), ids)
    assert (first - init).abs().max() > 1e-4  # trained by step 1
    assert (last - first).abs().max() > 1e-4  # and again by step 2


def test_hf_model_entry_is_not_announced_as_inert():
    cfg = load_config("grpo")
    ckpt = cfg.actor_rollout_ref.actor.checkpoint
    with_hf = dataclasses.replace(cfg)  # no provenance: every notice is given
    ckpt.save_contents = ["model", "optimizer", "extra", "hf_model"]
    assert not [n for n in startup_notices(with_hf) if "save_contents" in n]
    ckpt.save_contents = ["model", "hf_model"]
    assert [n for n in startup_notices(with_hf) if "save_contents" in n]
