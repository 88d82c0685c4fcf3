"""verl's data extension points: user objects loaded by path, a user dataset class
(data.custom_cls) and a user (curriculum) sampler (data.sampler), with exact resume."""

import json
import sys
import textwrap
from dataclasses import dataclass, field

import pytest

from megarl.data import RLDataset, write_rows
from megarl.data.extern import (
    CurriculumBatch,
    ExternSampler,
    load_custom_dataset,
    load_user_sampler,
    prompt_dataset,
    prompt_sampler,
)
from megarl.data.sampler import PromptSampler
from megarl.errors import UserInputError
from megarl.utils.extern import load_object


def row(q, gt, source="arith"):
    return {"data_source": source, "prompt": [{"role": "user", "content": q}],
            "reward_model": {"style": "rule", "ground_truth": gt},
            "extra_info": {"split": "train", "index": 0}}


ROWS = [row(f"{a}+{a + 1}", str(2 * a + 1)) for a in range(7)]

SAMPLERS = textwrap.dedent('''
    import torch
    from torch.utils.data import Dataset, RandomSampler
    from megarl.data.extern import AbstractCurriculumSampler, AbstractSampler

    class Seeded(AbstractSampler):
        """verl's test sampler, seeded from the data config (draws one permutation a pass)."""
        def __init__(self, data_source, data_config):
            g = torch.Generator()
            g.manual_seed(int(data_config["seed"]))
            self.inner = RandomSampler(data_source, generator=g)
        def __iter__(self):
            return iter(self.inner)
        def __len__(self):
            return len(self.inner)

    class Hardest(AbstractCurriculumSampler):
        """Yields the prompt with the lowest total score so far, ties by index; stateful."""
        def __init__(self, data_source, data_config):
            self.n = len(data_source)
            self.totals = [0.0] * self.n
            self.updates = 0
        def __iter__(self):
            for _ in range(self.n):
                yield min(range(self.n), key=lambda i: (self.totals[i], i))
        def __len__(self):
            return self.n
        def update(self, batch):
            self.updates += 1
            for i, s in zip(batch.index, batch.score):
                self.totals[i] += s
        def state_dict(self):
            return {"totals": list(self.totals), "updates": self.updates}
        def load_state_dict(self, state):
            self.totals, self.updates = list(state["totals"]), state["updates"]

    class Unsaveable(Hardest):
        def state_dict(self):
            return {"totals": {0.5: object()}}

    class OutOfRange(AbstractSampler):
        def __init__(self, data_source, data_config):
            self.n = len(data_source)
        def __iter__(self):
            return iter([0, self.n])

    class TensorIndices(AbstractSampler):
        def __init__(self, data_source, data_config):
            self.n = len(data_source)
        def __iter__(self):
            return iter(torch.arange(self.n - 1, -1, -1))

    class NotASampler:
        def __init__(self, data_source, data_config):
            pass

    class Rows(Dataset):
        """A generated dataset: rows of a+b problems, as many as the config says."""
        def __init__(self, data_files, tokenizer, processor, config, max_samples=-1):
            self.files, self.config = data_files, config
            self.n = int(config["n_rows"]) if max_samples < 0 else max_samples
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            return {"data_source": "arith",
                    "prompt": [{"role": "user", "content": f"{i}+{i + 1}"}],
                    "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
                    "extra_info": {"split": "train", "index": i}}

    class OldRows(Rows):
        """An older verl dataset signature (no max_samples)."""
        def __init__(self, data_files, tokenizer, processor, config):
            super().__init__(data_files, tokenizer, processor, config)

    class NotADataset:
        pass

    class BadRows(Rows):
        def __getitem__(self, i):
            return {"prompt": "no messages"}
''')


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "user_data.py"
    path.write_text(SAMPLERS)
    return str(path)


@pytest.mark.parametrize("form", ["file", "file://", "pkg"])
def test_load_object_by_file_or_module(user_file, form, monkeypatch):
    if form == "pkg":
        monkeypatch.syspath_prepend(str(user_file.rsplit("/", 1)[0]))
        path = "pkg://user_data"
    else:
        path = ("file://" if form == "file://" else "") + user_file
    cls = load_object(path, "Seeded", key="data.sampler.class_name")
    assert cls.__name__ == "Seeded" and cls.__doc__.startswith("verl's test sampler")
    sys.modules.pop("user_data", None)


def test_load_object_errors_name_the_key(user_file, tmp_path):
    with pytest.raises(UserInputError, match=r"data.sampler.class_name.*no such file"):
        load_object(str(tmp_path / "missing.py"), "X", key="data.sampler.class_name")
    with pytest.raises(UserInputError, match=r"data.custom_cls.name.*has no 'Nope'.*'Rows'"):
        load_object(user_file, "Nope", key="data.custom_cls.name")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UserInputError, match=r"data.custom_cls.name.*RuntimeError: boom"):
        load_object(str(broken), "X", key="data.custom_cls.name")
    with pytest.raises(UserInputError, match=r"module 'no_such_module_xyz' cannot be imported"):
        load_object("pkg://no_such_module_xyz", "X", key="data.sampler.class_name")


def test_custom_dataset_rows_equal_the_same_rows_from_a_file(user_file, tok, tmp_path):
    """The class's rows go through the same validation, template and tokenisation as a file
    holding them (written here by the test, read by the file path of RLDataset)."""
    n = 5
    ds = load_custom_dataset(user_file, "Rows", ["ignored.parquet"], tok, {"n_rows": n},
                             max_prompt_length=64)
    ref_path = str(tmp_path / "ref.jsonl")
    write_rows([{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i}+{i + 1}"}],
                 "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
                 "extra_info": {"split": "train", "index": i}} for i in range(n)], ref_path)
    ref = RLDataset(ref_path, tok, max_prompt_length=64)
    assert len(ds) == len(ref) == n
    for a, b in zip(ds.items, ref.items):
        assert (a.prompt_ids, a.ground_truth, a.extra_info, a.index) == \
            (b.prompt_ids, b.ground_truth, b.extra_info, b.index)
    old = load_custom_dataset(user_file, "OldRows", [], tok, {"n_rows": 3}, max_prompt_length=64)
    assert len(old) == 3


def test_custom_dataset_errors(user_file, tok):
    with pytest.raises(UserInputError, match="must be a class that inherits from torch"):
        load_custom_dataset(user_file, "NotADataset", [], tok, {}, max_prompt_length=64)
    with pytest.raises(UserInputError, match=r"Rows \(.*\): row 0: field 'prompt'"):
        load_custom_dataset(user_file, "BadRows", [], tok, {"n_rows": 2}, max_prompt_length=64)
    with pytest.raises(UserInputError, match=r"data.custom_cls.name='Rows'.*KeyError"):
        load_custom_dataset(user_file, "Rows", [], tok, {}, max_prompt_length=64)


def passes(user_file, n, seed, epochs):
    """Brute force: the index lists of `epochs` passes of a fresh user sampler."""
    s = load_user_sampler(user_file, "Seeded", list(range(n)), {"seed": seed})
    return [list(iter(s)) for _ in range(epochs)]


def test_batches_are_the_passes_cut_into_batches_dropping_each_tail(user_file):
    n, bs, seed = 10, 3, 7
    ref = [p[k:k + bs] for p in passes(user_file, n, seed, 3) for k in range(0, n - bs + 1, bs)]
    s = ExternSampler(load_user_sampler(user_file, "Seeded", list(range(n)), {"seed": seed}),
                      n, bs)
    assert s.batches_per_epoch == 3
    got = [s.next_batch() for _ in range(9)]
    assert [[int(i) for i in b] for b in got] == ref
    assert s.epoch == 2
    assert len(set(sum(got[:3], []))) == 9  # drop_last: 9 of the 10 indices of a pass


@pytest.mark.parametrize("drawn", [1, 3, 5])
def test_resume_by_replay_continues_exactly(user_file, drawn):
    n, bs = 10, 3
    make = lambda: ExternSampler(  # noqa: E731
        load_user_sampler(user_file, "Seeded", list(range(n)), {"seed": 3}), n, bs)
    straight = make()
    ref = [straight.next_batch() for _ in range(drawn + 4)]
    first = make()
    for _ in range(drawn):
        first.next_batch()
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(4)] == ref[drawn:]
    assert resumed.epoch == straight.epoch


def test_curriculum_sampler_sees_each_step_and_resumes_from_its_own_state(user_file):
    n = 4
    make = lambda: ExternSampler(  # noqa: E731
        load_user_sampler(user_file, "Hardest", list(range(n)), {}), n, 2)
    s = make()
    assert s.curriculum
    assert s.next_batch() == [0, 0]  # no scores yet: the lowest index, twice
    s.update(CurriculumBatch(index=[0, 1, 2, 3], score=[1.0, 0.5, 0.0, 2.0], step=1))
    assert s.next_batch() == [2, 2]  # the lowest mean score now
    state = json.loads(json.dumps(s.state_dict()))  # as trainer_state.json keeps it
    assert state["sampler"] == {"totals": [1.0, 0.5, 0.0, 2.0], "updates": 1}
    s.update(CurriculumBatch(index=[2], score=[5.0], step=2))
    after = s.next_batch()
    resumed = make()
    resumed.load_state_dict(state)
    resumed.update(CurriculumBatch(index=[2], score=[5.0], step=2))
    assert resumed.next_batch() == after == [1, 1]


def test_sampler_errors_name_the_key(user_file):
    with pytest.raises(UserInputError, match=r"data.sampler.class_name='NotASampler' is not a "
                                             r"sampler"):
        load_user_sampler(user_file, "NotASampler", [0, 1], {})
    bad = ExternSampler(load_user_sampler(user_file, "OutOfRange", [0, 1, 2], {}), 3, 2)
    with pytest.raises(UserInputError, match="yielded index 3, outside the dataset's 3"):
        bad.next_batch()
    short = ExternSampler(load_user_sampler(user_file, "Seeded", [0, 1], {"seed": 0}), 2, 3)
    with pytest.raises(UserInputError, match=r"fewer than one batch \(2 < 3"):
        short.next_batch()
    with pytest.raises(UserInputError, match="megarl's own sampler"):
        short.load_state_dict({"epoch": 0, "position": 0, "seed": 1})


def test_tensor_indices_are_taken_as_ints(user_file):
    s = ExternSampler(load_user_sampler(user_file, "TensorIndices", list(range(4)), {}), 4, 4)
    batch = s.next_batch()
    assert batch == [3, 2, 1, 0] and all(type(i) is int for i in batch)


def test_unserialisable_sampler_state_is_refused(user_file):
    s = ExternSampler(load_user_sampler(user_file, "Unsaveable", [0, 1], {}), 2, 1)
    with pytest.raises(UserInputError, match="state_dict\\(\\) must be JSON-serialisable"):
        s.state_dict()


@dataclass
class _Pair:
    path: str | None = None
    name: str | None = None


@dataclass
class _SamplerPair:
    class_path: str | None = None
    class_name: str | None = None


@dataclass
class _Data:
    """The fields of the data config these functions read."""
    custom_cls: _Pair = field(default_factory=_Pair)
    sampler: _SamplerPair = field(default_factory=_SamplerPair)
    shuffle: bool = True
    seed: int = 5
    n_rows: int = 6


def test_config_picks_the_user_classes_or_megarl_own(user_file, tok, tmp_path):
    path = str(tmp_path / "rows.jsonl")
    write_rows(ROWS, path)
    plain = prompt_dataset(_Data(), path, tokenizer=tok, max_prompt_length=64)
    assert len(plain) == len(ROWS)
    mine = prompt_sampler(_Data(), plain, 2)
    assert isinstance(mine, PromptSampler) and mine.seed == 5
    cfg = _Data(custom_cls=_Pair(user_file, "Rows"), sampler=_SamplerPair(user_file, "Seeded"))
    ds = prompt_dataset(cfg, path, tokenizer=tok, max_prompt_length=64)
    assert len(ds) == 6  # the class's rows (config n_rows), not the file's 7
    sampler = prompt_sampler(cfg, ds, 2)
    # the user's sampler got the data section as a read-only mapping: seed 5 as given
    ref = passes(user_file, 6, 5, 1)[0]
    assert isinstance(sampler, ExternSampler) and sampler.next_batch() == ref[:2]
    with pytest.raises(UserInputError, match=r"data.custom_cls.name is not set"):
        prompt_dataset(_Data(custom_cls=_Pair(user_file, None)), path, tokenizer=tok,
                       max_prompt_length=64)
    with pytest.raises(UserInputError, match=r"data.sampler.class_path is not set"):
        prompt_sampler(_Data(sampler=_SamplerPair(None, "Seeded")), ds, 2)
    with pytest.raises(UserInputError, match="came from a user sampler"):
        mine.load_state_dict(sampler.state_dict())
