"""HF checkpoint folders without transformers: config.json + safetensors (single or sharded).

Layout written by `save_hf_checkpoint` is the one ``PreTrainedModel.save_pretrained`` writes:
``model.safetensors`` when everything fits in one shard, else ``model-0000k-of-0000N.safetensors``
plus ``model.safetensors.index.json`` (``metadata.total_size``, ``metadata.total_parameters``,
``weight_map``); shards are filled greedily in HF state_dict order, a tensor larger than the
limit gets a shard of its own (huggingface_hub's rule), so the same tensors and limit give the
same files as transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.models.state_dict_adapter import hf_sort_key

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes, huggingface_hub's default "5GB"
# Files copied verbatim from a source folder next to the weights (tokenizer, chat template, ...).
AUX_FILE_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "generation_config.json",
    "chat_template*",
    "preprocessor_config.json",
)
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def read_hf_config(
    path: str | os.PathLike,
    override_config: Mapping[str, Any] | None = None,
    *,
    key: str = "actor_rollout_ref.model.override_config",
) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF folder, with verl's ``model.override_config`` block
    ``override_config`` merged in (`megarl.models.overrides.apply_hf_overrides`; ``key`` names
    the block in its errors)."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path!s}: is this an HF model folder?")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    if not override_config:
        return config
    from megarl.models.overrides import apply_hf_overrides

    return apply_hf_overrides(config, override_config, key)


def hf_weight_map(path: str | os.PathLike) -> dict[str, str]:
    """{tensor name: file name} of an HF folder (from the index, or the single file's keys)."""
    path = Path(path)
    index = path / INDEX_NAME
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        missing = sorted({v for v in weight_map.values() if not (path / v).is_file()})
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
        return dict(weight_map)
    single = path / SINGLE_NAME
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_NAME)
    raise FileNotFoundError(
        f"no {SINGLE_NAME} or {INDEX_NAME} in {path!s} (only safetensors checkpoints are read; "
        "convert *.bin checkpoints with transformers first)"
    )


def iter_hf_tensors(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily yield (name, tensor) of an HF folder, one tensor in memory at a time, in HF
    state_dict order. ``dtype`` casts floating-point tensors (others keep theirs)."""
    path = Path(path)
    weight_map = hf_weight_map(path)
    by_file: dict[str, list[str]] = {}
    for name in sorted(weight_map, key=hf_sort_key):
        by_file.setdefault(weight_map[name], []).append(name)
    # Files in the order their first tensor appears, so a sharded folder streams in model order.
    for file, names in by_file.items():
        with safe_open(path / file, framework="pt", device=str(device)) as f:
            for name in names:
                t = f.get_tensor(name)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                yield name, t


def load_hf_state_dict(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder as {name: tensor}, in HF state_dict order."""
    return dict(iter_hf_tensors(path, dtype=dtype, device=device))


def parse_shard_size(size: int | str) -> int:
    """Bytes from an int or an HF-style string ("5GB", "200MB", "10KB"; decimal units)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be > 0 bytes, got {size}")
        return size
    unit = size.strip()[-2:].upper()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"max_shard_size {size!r}: use bytes (int) or a KB/MB/GB/TB string")
    return int(float(size.strip()[:-2]) * _SIZE_UNITS[unit])


def save_hf_checkpoint(
    directory: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    config: Mapping[str, Any],
    *,
    max_shard_size_bytes: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    source_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an HF checkpoint folder atomically and return its path.

    tensors:  {name: tensor} or a stream of (name, tensor) in HF state_dict order (e.g.
              ``Backend.export_weights()``); at most one shard is held in memory. Names are written
              as given (use `state_dict_adapter.to_hf` to drop tied heads).
    config:   written as config.json (``dtype``/``torch_dtype`` updated when ``dtype`` is given).
    dtype:    cast floating-point tensors before writing.
    source_dir: copy tokenizer / generation / chat-template files (``AUX_FILE_PATTERNS``) from it.
    overwrite: replace an existing non-empty ``directory`` (refused otherwise).

    Everything is written to a temp folder next to ``directory``, fsynced, then renamed into place.
    """
    directory = Path(directory)
    max_bytes = parse_shard_size(max_shard_size_bytes)
    if _non_empty_dir(directory) and not overwrite:
        raise FileExistsError(
            f"{directory} exists and is not empty; pass overwrite=True to replace it"
        )
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} exists and is not a directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        _write_weights(tmp, tensors, max_bytes, dtype)
        config = dict(config)
        if dtype is not None:
            for key in ("dtype", "torch_dtype"):
                if key in config:
                    config[key] = str(dtype).removeprefix("torch.")
        _write_text(tmp / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
        if source_dir is not None:
            _copy_aux_files(Path(source_dir), tmp)
        _fsync_dir(tmp)
        _swap_into_place(tmp, directory, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


# ---------------------------------------------------------------------------------------------


def _write_weights(
    tmp: Path,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    max_bytes: int,
    dtype: torch.dtype | None,
) -> None:
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    shard_files: list[tuple[Path, list[str]]] = []  # written in HF's shard order
    seen: set[str] = set()
    current: dict[str, torch.Tensor] = {}
    current_size = total_size = total_params = 0

    def flush(shard: dict[str, torch.Tensor]) -> None:
        file = tmp / f".shard-{len(shard_files):05d}.safetensors"
        save_file(shard, str(file), metadata={"format": "pt"})
        _fsync_file(file)
        shard_files.append((file, list(shard)))

    for name, tensor in items:
        if name in seen:
            raise ValueError(f"tensor name {name!r} given twice")
        seen.add(name)
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        size = t.numel() * t.element_size()
        total_size += size
        total_params += t.numel()
        if size > max_bytes:  # alone in its own shard, placed before the one being filled
            flush({name: t})
            continue
        if current_size + size > max_bytes:
            flush(current)
            current, current_size = {}, 0
        current[name] = t
        current_size += size
    if current or not shard_files:
        flush(current)

    if len(shard_files) == 1:
        os.replace(shard_files[0][0], tmp / SINGLE_NAME)
        return
    n = len(shard_files)
    weight_map: dict[str, str] = {}
    for i, (file, names) in enumerate(shard_files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(file, tmp / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {
        "metadata": {"total_parameters": total_params, "total_size": total_size},
        "weight_map": weight_map,
    }
    _write_text(tmp / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")


def _copy_aux_files(source: Path, dest: Path) -> None:
    if not source.is_dir():
        raise FileNotFoundError(f"source_dir {source} is not a directory")
    for pattern in AUX_FILE_PATTERNS:
        for file in sorted(source.glob(pattern)):
            if file.is_file() and not (dest / file.name).exists():
                shutil.copyfile(file, dest / file.name)
                _fsync_file(dest / file.name)


def _swap_into_place(tmp: Path, directory: Path, overwrite: bool) -> None:
    old = None
    if directory.exists():
        if _non_empty_dir(directory):
            if not overwrite:  # appeared while we were writing
                raise FileExistsError(f"{directory} became non-empty while saving")
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
            os.replace(directory, old)  # onto an empty dir: atomic on POSIX
        else:
            directory.rmdir()
    os.replace(tmp, directory)
    _fsync_dir(directory.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _non_empty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _write_text(file: Path, text: str) -> None:
    with open(file, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
