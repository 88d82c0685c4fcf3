"""``launch/train.py`` with every fully asynchronous batch recorded (rank 0 writes them):

    python tests/trainer/fully_async_probe.py OUT.json launch/train.py --config grpo ...

OUT.json: one row per learner step: its step, the dataset index (``extra_info.index``) of each
prompt of the batch and the policy version of each of their samples. Read by
test_fully_async.py."""

from __future__ import annotations

import json
import runpy
import sys

from megarl.trainer.fully_async import FullyAsyncProducer
from megarl.utils import dist as mdist

out = sys.argv.pop(1)
produce = FullyAsyncProducer.produce
rows: list[dict] = []


def recording(self, step, timer):
    batch, metrics = produce(self, step, timer)
    if mdist.rank() == 0:
        groups = batch.tensors["policy_version"].tolist()
        rows.append({"step": step, "versions": groups,
                     "prompts": sorted({int(info["index"]) for info in batch.extra_infos})})
        with open(out, "w") as f:
            json.dump(rows, f)
    return batch, metrics


FullyAsyncProducer.produce = recording
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
