"""verl's data extension points: a user's dataset class and a user's (curriculum) sampler.

``data.custom_cls.{path,name}``: a ``torch.utils.data.Dataset`` subclass, built as verl builds
it, ``cls(data_files=..., tokenizer=..., processor=None, config=<the data section>,
max_samples=-1)`` (``max_samples`` only where the constructor takes it). Each item is one row in
verl's parquet format (``prompt`` messages under ``data.prompt_key``, ``data_source``,
``reward_model.ground_truth``, ``extra_info``): the class decides which rows exist (generated,
filtered, mixed from several sources), megarl validates, renders and tokenises them like file
rows (`RLDataset.from_rows`). All items are read once at start-up.

``data.sampler.{class_path,class_name}``: built as ``cls(data_source=dataset,
data_config=<the data section>)``; iterating it yields dataset indices, one pass per epoch
(verl's ``AbstractSampler``). A sampler with ``update(batch)`` is a curriculum sampler (verl's
``AbstractCurriculumSampler``): after every step it gets that step's `CurriculumBatch` and may
change the order of what it has not yielded yet (it is read lazily, one batch at a time).
The sampler runs on every rank and must draw the same indices everywhere: seed it from
``data_config.seed``, not from the global random state.

Resume: a sampler with ``state_dict()`` / ``load_state_dict()`` (torchdata's ``Stateful``)
is restored from its own state, which must be JSON-serialisable (it is kept in the checkpoint's
``trainer_state.json``). Any other is rebuilt and replayed to the saved position
(epochs done, indices drawn), which continues exactly when its order depends only on its seed
and epoch count; a curriculum sampler without its own state resumes without the updates it saw.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from abc import abstractmethod
from collections.abc import Iterator, Sized
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset, Sampler

from megarl.data.dataset import RLDataset
from megarl.data.sampler import PromptSampler
from megarl.errors import UserInputError
from megarl.utils.extern import load_object

SAMPLER_KEY = "data.sampler.class_name"
DATASET_KEY = "data.custom_cls.name"


class AbstractSampler(Sampler[int]):
    """verl's sampler interface (``verl.experimental.dataset.sampler``): a port changes its
    import to ``megarl.data.extern``."""

    @abstractmethod
    def __init__(self, data_source: Sized, data_config: Any) -> None: ...


class AbstractCurriculumSampler(AbstractSampler):
    """A sampler told about every finished step (`CurriculumBatch`)."""

    @abstractmethod
    def update(self, batch: CurriculumBatch) -> None: ...


@dataclass
class CurriculumBatch:
    """One finished training step, for a curriculum sampler; one entry per response.

    index:       dataset index of the response's prompt (what the sampler yielded)
    score:       the response's sequence reward (the verifiable score before KL)
    data_source: the prompt row's data_source
    extra_info:  the prompt row's extra_info
    step:        the trainer step that used the batch (1-based)
    """

    index: list[int]
    score: list[float]
    data_source: list[str] = field(default_factory=list)
    extra_info: list[dict] = field(default_factory=list)
    step: int = 0


def load_custom_dataset(path: str, name: str, files: list[str], tokenizer: Any,
                        data_config: Any, **dataset_kwargs: Any) -> RLDataset:
    """The rows of the user's dataset class as an `RLDataset` (``dataset_kwargs``: those of
    `RLDataset.from_rows` after ``tokenizer``)."""
    cls = load_object(path, name, key=DATASET_KEY)
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise UserInputError(f"{DATASET_KEY}={name!r} in {path!r} must be a class that inherits "
                             "from torch.utils.data.Dataset (verl's rule)")
    kwargs: dict[str, Any] = dict(data_files=files, tokenizer=tokenizer, processor=None,
                                  config=data_config)
    params = inspect.signature(cls).parameters
    if "max_samples" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["max_samples"] = -1
    try:
        dataset = cls(**kwargs)
        rows = [dataset[i] for i in range(len(dataset))]
    except UserInputError:
        raise
    except Exception as err:
        raise UserInputError(f"{DATASET_KEY}={name!r}: building or reading the dataset failed "
                             f"with {type(err).__name__}: {err}") from err
    return RLDataset.from_rows(f"{name} ({path})", rows, tokenizer, **dataset_kwargs)


def load_user_sampler(path: str, name: str, dataset: Sized, data_config: Any) -> Any:
    """The user's sampler, built as verl builds it; checked to be iterable."""
    cls = load_object(path, name, key=SAMPLER_KEY)
    if not callable(cls):
        raise UserInputError(f"{SAMPLER_KEY}={name!r} in {path!r} is not a class")
    try:
        sampler = cls(data_source=dataset, data_config=data_config)
    except Exception as err:
        raise UserInputError(f"{SAMPLER_KEY}={name!r}: building it as cls(data_source=, "
                             f"data_config=) failed with {type(err).__name__}: {err}") from err
    if not callable(getattr(sampler, "__iter__", None)):
        raise UserInputError(f"{SAMPLER_KEY}={name!r} is not a sampler: it has no __iter__ "
                             "yielding dataset indices (subclass megarl.data.extern."
                             "AbstractSampler)")
    return sampler


class ExternSampler:
    """`PromptSampler`'s interface (global batches, epochs, checkpointed position) over a user
    sampler. An epoch is one pass of ``iter(sampler)``; its incomplete last batch is dropped
    (verl's training dataloader drops it too)."""

    def __init__(self, sampler: Any, n: int, batch_size: int):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.sampler, self.n, self.batch_size = sampler, n, batch_size
        self.epoch = 0
        self.position = 0  # indices of the current epoch already drawn
        self._it: Iterator[int] | None = None

    @property
    def curriculum(self) -> bool:
        return callable(getattr(self.sampler, "update", None))

    @property
    def batches_per_epoch(self) -> int:
        length = len(self.sampler) if hasattr(self.sampler, "__len__") else self.n
        return length // self.batch_size

    def _draw(self) -> int | None:
        if self._it is None:
            self._it = iter(self.sampler)
        try:
            i = next(self._it)
        except StopIteration:
            return None
        if isinstance(i, bool) or not isinstance(i, int) and not hasattr(i, "__index__"):
            raise UserInputError(f"{SAMPLER_KEY}: the sampler yielded {i!r}, not a dataset "
                                 "index")
        i = int(i)
        if not 0 <= i < self.n:
            raise UserInputError(f"{SAMPLER_KEY}: the sampler yielded index {i}, outside the "
                                 f"dataset's {self.n} prompts")
        self.position += 1
        return i

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` indices; a new epoch (a new pass) when this one runs out."""
        batch: list[int] = []
        fresh = self.position == 0 and self._it is None
        while len(batch) < self.batch_size:
            i = self._draw()
            if i is not None:
                batch.append(i)
                continue
            if fresh:
                raise UserInputError(f"{SAMPLER_KEY}: one pass of the sampler yields fewer than "
                                     f"one batch ({len(batch)} < {self.batch_size} indices)")
            self.epoch, self.position, self._it, batch, fresh = self.epoch + 1, 0, None, [], True
        return batch

    def update(self, batch: CurriculumBatch) -> None:
        """Tell a curriculum sampler about a finished step (no-op for any other)."""
        if self.curriculum:
            self.sampler.update(batch)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kind": "extern", "epoch": self.epoch,
                                 "position": self.position, "n": self.n}
        if callable(getattr(self.sampler, "state_dict", None)):
            own = self.sampler.state_dict()
            try:
                json.dumps(own)
            except (TypeError, ValueError) as err:
                raise UserInputError(f"{SAMPLER_KEY}: the sampler's state_dict() must be "
                                     f"JSON-serialisable (the trainer state is JSON): {err}"
                                     ) from err
            state["sampler"] = own
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position: from the sampler's own state when it has one, else by drawing
        the saved epochs and indices again."""
        if state.get("kind") != "extern":
            raise UserInputError("the checkpoint's prompts came from megarl's own sampler, not "
                                 f"{SAMPLER_KEY}; resume with the sampler settings it was "
                                 "saved with, or start a fresh run")
        if int(state.get("n", self.n)) != self.n:
            raise UserInputError(f"the sampler checkpoint was taken on {state['n']} prompts but "
                                 f"the dataset now has {self.n}; use the same data")
        epoch, position = int(state["epoch"]), int(state["position"])
        self.epoch, self.position, self._it = epoch, 0, None
        if "sampler" in state and callable(getattr(self.sampler, "load_state_dict", None)):
            self.sampler.load_state_dict(state["sampler"])
            self.position = position
            return
        for _ in range(epoch):
            for _ in iter(self.sampler):
                pass
        for _ in range(position):
            if self._draw() is None:
                raise UserInputError(f"{SAMPLER_KEY}: replaying the sampler to the checkpoint's "
                                     f"position ({position} of epoch {epoch}) ran out of "
                                     "indices: its order is not reproducible from its seed")


def data_section(data_config: Any) -> Any:
    """The ``data`` config section (`megarl.config.schema`'s, one layer up) as the user's
    classes get it: a read-only OmegaConf mapping (verl hands them a DictConfig:
    ``config.get("key", default)``, ``config.key``, ``config["key"]``)."""
    from omegaconf import OmegaConf

    plain = (dataclasses.asdict(data_config) if dataclasses.is_dataclass(data_config)
             else data_config)
    section = OmegaConf.create(plain)
    OmegaConf.set_readonly(section, True)
    return section


def _pair(path: str | None, name: str | None, path_key: str, name_key: str) -> bool:
    if path and not name:
        raise UserInputError(f"{name_key} is not set: name the class in {path_key}={path!r}")
    if name and not path:
        raise UserInputError(f"{path_key} is not set: give the module (pkg://<module> or a .py "
                             f"file) that defines {name_key}={name!r}")
    return bool(path)


def prompt_dataset(data_config: Any, files: Any, **dataset_kwargs: Any) -> RLDataset:
    """``data.custom_cls`` set (``data_config``: the ``data`` section): the user class's rows;
    else the rows of ``files``. ``dataset_kwargs``: `RLDataset`'s (tokenizer included)."""
    c = data_config.custom_cls
    if not _pair(c.path, c.name, "data.custom_cls.path", DATASET_KEY):
        return RLDataset(files, **dataset_kwargs)
    tokenizer = dataset_kwargs.pop("tokenizer")
    files = [files] if isinstance(files, str) else list(files or [])
    return load_custom_dataset(c.path, c.name, files, tokenizer, data_section(data_config),
                               **dataset_kwargs)


def prompt_sampler(data_config: Any, dataset: Sized,
                   batch_size: int) -> PromptSampler | ExternSampler:
    """``data.sampler`` set (``data_config``: the ``data`` section): the user's sampler behind
    `ExternSampler`; else megarl's seeded shuffle (`PromptSampler`, ``data.shuffle`` /
    ``data.seed``)."""
    s = data_config.sampler
    if not _pair(s.class_path, s.class_name, "data.sampler.class_path", SAMPLER_KEY):
        return PromptSampler(len(dataset), batch_size, shuffle=data_config.shuffle,
                             seed=data_config.seed)
    user = load_user_sampler(s.class_path, s.class_name, dataset, data_section(data_config))
    return ExternSampler(user, len(dataset), batch_size)
