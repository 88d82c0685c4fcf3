"""Worker of tests/trainer/test_learning.py: one training step of a recipe, in this process (a
world of one), keeping what the step trained on and the actor's weights before and after it.

usage: python tests/trainer/first_update_probe.py OUT RECIPE [key=value ...]

Writes OUT/batch.safetensors (prompt_ids, prompt_mask, response_ids, response_mask,
group_index, scores: the rows of the step as the trainer padded them) and
OUT/before.safetensors, OUT/after.safetensors (the actor's weights, HF names).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _weights(backend) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in backend.export_weights()}


def main() -> None:
    from safetensors.torch import save_file

    from megarl.config.loader import resolve_config
    from megarl.trainer.parts import pin_threads
    from megarl.trainer.trainer import RLTrainer
    from megarl.utils import dist as mdist

    out, recipe, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    cfg = resolve_config(recipe, overrides).config
    pin_threads()
    mdist.init_distributed(mdist.resolve_device(cfg.trainer.device), cfg.launch.backend)
    trainer = RLTrainer(cfg)
    kept = {}
    rollout = trainer.producer.produce

    def keep(step, timer):
        kept["batch"], metrics = rollout(step, timer)
        return kept["batch"], metrics

    trainer.producer.produce = keep
    save_file(_weights(trainer.parts.actor), str(out / "before.safetensors"))
    trainer.step = 1
    trainer.train_step()
    save_file(_weights(trainer.parts.actor), str(out / "after.safetensors"))
    b = kept["batch"]
    save_file({"prompt_ids": b.prompt_ids, "prompt_mask": b.prompt_mask,
               "response_ids": b.response_ids, "response_mask": b.response_mask,
               "group_index": b.group_index,
               "scores": b.tensors["verifiable"].float()}, str(out / "batch.safetensors"))
    trainer.parts.close()
    mdist.destroy()


if __name__ == "__main__":
    main()
