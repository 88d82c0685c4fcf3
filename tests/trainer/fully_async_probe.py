"""``launch/train.py`` with every fully asynchronous batch recorded (rank 0 writes them):

    python tests/trainer/fully_async_probe.py OUT.json [--kill-worker-at=STEP] launch/train.py ...

OUT.json: one row per learner step: its step, the dataset index (``extra_info.index``) of each
prompt of the batch, the policy version of each of their samples and, where tracked, the
version of each of their response tokens. ``--kill-worker-at``:
rollout worker 1 is killed (SIGKILL) as that step begins. Read by test_fully_async.py."""

from __future__ import annotations

import json
import runpy
import sys

from megarl.trainer.fully_async import FullyAsyncProducer
from megarl.utils import dist as mdist

out = sys.argv.pop(1)
kill_at = int(sys.argv.pop(1).split("=")[1]) if sys.argv[1].startswith("--kill") else None
produce = FullyAsyncProducer.produce
rows: list[dict] = []


def recording(self, step, timer):
    if step == kill_at and mdist.rank() == 0:
        victim = self.parts.engine.procs[1]
        victim.kill()
        victim.join()
    batch, metrics = produce(self, step, timer)
    if mdist.rank() == 0:
        groups = batch.tensors["policy_version"].tolist()
        row = {"step": step, "versions": groups,
               "prompts": sorted({int(info["index"]) for info in batch.extra_infos})}
        if "token_version" in batch.tensors:  # each sample's, over its response tokens
            lengths = batch.response_mask.sum(1).long().tolist()
            row["token_versions"] = [v[:n] for v, n in
                                     zip(batch.tensors["token_version"].tolist(), lengths)]
        rows.append(row)
        with open(out, "w") as f:
            json.dump(rows, f)
    return batch, metrics


FullyAsyncProducer.produce = recording
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
