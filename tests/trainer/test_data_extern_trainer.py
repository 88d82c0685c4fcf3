"""A run on a user's dataset class (data.custom_cls) ordered by a user's curriculum sampler
(data.sampler): the prompts trained on are the class's rows, in the order the sampler gives
after hearing each step's scores. Reference: the rollout dump (trainer.rollout_data_dir, the
decoded prompts and their scores) and the sampler's rule, brute-forced here."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
from trainer_helpers import train

pytestmark = pytest.mark.e2e

USER = textwrap.dedent('''
    import json
    import os

    from torch.utils.data import Dataset

    from megarl.data.extern import AbstractCurriculumSampler


    class Sums(Dataset):
        """Eight one-operation sums in verl's row format (no data file read)."""

        def __init__(self, data_files, tokenizer, processor, config, max_samples=-1):
            self.n = 8

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return {"data_source": "arith",
                    "prompt": [{"role": "user", "content": f"Compute: {10 + i}+{20 + i}"}],
                    "reward_model": {"style": "rule", "ground_truth": str(30 + 2 * i)},
                    "extra_info": {"index": i}}


    class BestFirst(AbstractCurriculumSampler):
        """Lazily yields the index with the highest score total, then the fewest draws, then
        the lowest index; every update is appended to $CURRICULUM_LOG."""

        def __init__(self, data_source, data_config):
            self.n = len(data_source)
            self.total = [0.0] * self.n
            self.drawn = [0] * self.n

        def __iter__(self):
            for _ in range(self.n):
                i = min(range(self.n), key=lambda k: (-self.total[k], self.drawn[k], k))
                self.drawn[i] += 1
                yield i

        def __len__(self):
            return self.n

        def update(self, batch):
            for i, s in zip(batch.index, batch.score):
                self.total[i] += s
            with open(os.environ["CURRICULUM_LOG"], "a") as f:
                f.write(json.dumps({"step": batch.step, "index": batch.index,
                                    "score": batch.score,
                                    "extra": [e["index"] for e in batch.extra_info]}) + "\\n")
''')


def _asked(text: str) -> int:
    """The row index of a decoded prompt 'Compute: {10 + i}+{20 + i}'."""
    a, b = map(int, re.search(r"Compute: (\d+)\+(\d+)", text).groups())
    assert b == a + 10
    return a - 10


def test_custom_dataset_and_curriculum_sampler_drive_the_run(tmp_path, monkeypatch):
    user = tmp_path / "user_data.py"
    user.write_text(USER)
    log = tmp_path / "curriculum.jsonl"
    monkeypatch.setenv("CURRICULUM_LOG", str(log))
    dump = tmp_path / "dump"
    train(tmp_path / "run", "grpo", "trainer.total_training_steps=2",
          f"data.custom_cls.path={user}", "data.custom_cls.name=Sums",
          f"data.sampler.class_path={user}", "data.sampler.class_name=BestFirst",
          f"trainer.rollout_data_dir={dump}")
    updates = [json.loads(line) for line in log.read_text().splitlines()]
    assert [u["step"] for u in updates] == [1, 2]
    rows = {s: [json.loads(x) for x in open(dump / f"{s}.jsonl")] for s in (1, 2)}
    for u in updates:  # the update names each response's row, with its dumped score
        dumped = rows[u["step"]]
        assert u["index"] == [_asked(r["input"]) for r in dumped] == u["extra"]
        assert u["score"] == pytest.approx([r["score"] for r in dumped])
    # brute force of the sampler's rule: step 1 = rows 0-3 (nothing scored yet), step 2 = the
    # four best-scored rows of step 1's (ties: never drawn, then lowest index)
    total, drawn = [0.0] * 8, [0] * 8
    expected = []
    for step in (1, 2):
        picks = []
        for _ in range(4):
            i = min(range(8), key=lambda k: (-total[k], drawn[k], k))
            drawn[i] += 1
            picks.append(i)
        expected.append(picks)
        for i, s in zip(updates[step - 1]["index"], updates[step - 1]["score"]):
            total[i] += s
    for step, picks in zip((1, 2), expected):
        assert sorted({_asked(r["input"]) for r in rows[step]}) == sorted(set(picks)), step
