"""``launch/train.py`` with every batch the step scores recorded (rank 0 writes them):

    python tests/trainer/orm_probe.py OUT.json launch/train.py --config grpo ...
    torchrun --nproc_per_node=2 tests/trainer/orm_probe.py OUT.json launch/train.py ...

OUT.json: a list of rows, one per scored response: its prompt and response ids, its prompt's
chat messages (the dataset item's ``raw_prompt``) and the training score the step used (an
outcome reward model's in place of the rule reward). Read by test_outcome_rm_trainer.py."""

from __future__ import annotations

import json
import runpy
import sys

from megarl.trainer import outcome_rm
from megarl.trainer.reward_assembly import RewardAssembly
from megarl.utils import dist as mdist

out = sys.argv.pop(1)
score = RewardAssembly.score
rows: list[dict] = []


def recording(self, samples, items=None, group_offset=0, timer=None):
    scores, metrics = score(self, samples, items, group_offset, timer)
    if mdist.rank() == 0:
        messages = outcome_rm.prompt_messages(samples, items, group_offset)
        rows.extend({"prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids),
                     "messages": m, "score": float(x)}
                    for s, m, x in zip(samples, messages, scores.tolist()))
        with open(out, "w") as f:
            json.dump(rows, f)
    return scores, metrics


RewardAssembly.score = recording
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
