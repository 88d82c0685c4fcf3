"""LoRA (low-rank adapters) for `megarl.models.Transformer`, with PEFT's semantics and files.

A targeted ``nn.Linear`` becomes a `LoRALinear`: the same ``weight`` / ``bias`` Parameters
(frozen, HF names unchanged) plus ``lora_A`` [r, in] and ``lora_B`` [out, r]:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

``lora_A`` is drawn as PEFT draws it (``kaiming_uniform_(a=sqrt(5))``, nn.Linear's default),
``lora_B`` starts at zero, so a fresh adapter leaves the model's outputs unchanged.

Which modules (``target_modules``, ``exclude_modules``: verl's keys, PEFT's rules):

- ``"all-linear"``: every ``nn.Linear`` except the output head (``lm_head`` / ``score``);
- another string: a regular expression that must match the whole module name;
- a list: a module whose name equals an entry or ends with ``"." + entry`` (``"q_proj"``
  selects ``model.layers.{i}.self_attn.q_proj`` of every layer);
- ``exclude_modules`` (checked first): a string is a full-match regular expression, a list is
  matched like ``target_modules``'s list.

Mixture-of-experts layers: the selection is the same rule over megarl's per-expert linears,
which PEFT does not see (transformers fuses the experts into tensors), so the PEFT file format
and equivalence hold for dense models; the training backend refuses LoRA on MoE policies.

Files: `save_peft_adapter` writes PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``
(keys ``base_model.model.<module>.lora_{A,B}.weight``), which ``peft.PeftModel.from_pretrained``
loads onto the transformers model of the same folder; `merged_state_dict` gives the HF tensors
with ``W + (alpha / r) B A`` folded in, for `save_merged` (a plain HF folder) or an engine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megarl.errors import UserInputError

ALL_LINEAR = "all-linear"
HEAD_MODULES = ("lm_head", "score")  # never targeted by "all-linear"
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

TargetModules = str | Sequence[str]


@dataclass(frozen=True)
class LoraSettings:
    """One adapter's shape and placement (verl: ``actor_rollout_ref.model.lora_rank`` etc.).

    rank:    r, the inner dimension of B A (> 0).
    alpha:   scale numerator: the update is (alpha / rank) B A.
    target_modules / exclude_modules: see the module docstring.
    dropout: probability of dropping adapter inputs in training (0 = none, verl's default).
    """

    rank: int
    alpha: float
    target_modules: TargetModules = ALL_LINEAR
    exclude_modules: TargetModules | None = None
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (its own ``weight`` and ``bias``, shared with the layer it replaces)
    plus a rank-r adapter. Input [..., in] -> output [..., out] in the input's dtype.

    ``adapter_enabled`` False: the plain linear (the reference model of an RL run)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 *, generator: torch.Generator | None = None) -> None:
        nn.Module.__init__(self)
        if rank <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {rank}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        fk = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **fk)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **fk)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True
        self.reset_lora_parameters(generator)

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """A: kaiming-uniform with a = sqrt(5) (PEFT's default), B: zeros."""
        if self.lora_A.weight.device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return y
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A [out, in], in the weight's dtype."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------


def _matches_list(name: str, entries: Sequence[str]) -> bool:
    return name in entries or any(name.endswith(f".{e}") for e in entries)


def _excluded(name: str, exclude: TargetModules | None) -> bool:
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, name) is not None
    return _matches_list(name, list(exclude))


def _targeted(name: str, module: nn.Module, target: TargetModules) -> bool:
    if isinstance(target, str):
        if target.lower() == ALL_LINEAR:
            return isinstance(module, nn.Linear) and name not in HEAD_MODULES
        return re.fullmatch(target, name) is not None
    return _matches_list(name, list(target))


def select_modules(model: nn.Module, target_modules: TargetModules = ALL_LINEAR,
                   exclude_modules: TargetModules | None = None) -> list[str]:
    """Names of the modules of ``model`` that LoRA adapts (module order). Adapter submodules
    (``lora_A`` / ``lora_B``) are never selected. Raises UserInputError when a selected module
    is not a linear layer or nothing is selected."""
    names, inner = [], set()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            inner.update(f"{name}.{s}" for s, _ in module.named_modules() if s)
    for name, module in model.named_modules():
        if not name or name in inner or _excluded(name, exclude_modules):
            continue
        if not _targeted(name, module, target_modules):
            continue
        if not isinstance(module, nn.Linear):
            raise UserInputError(
                f"actor_rollout_ref.model.target_modules={target_modules!r} selects {name} "
                f"({type(module).__name__}), which is not a linear layer; LoRA adapts linear "
                "layers only: name linear modules (q_proj, k_proj, v_proj, o_proj, gate_proj, "
                "up_proj, down_proj) or use all-linear")
        names.append(name)
    if not names:
        raise UserInputError(
            f"actor_rollout_ref.model.target_modules={target_modules!r} (exclude_modules="
            f"{exclude_modules!r}) selects no module of the model; use all-linear or module "
            "names such as [q_proj, v_proj]")
    return names


# ---------------------------------------------------------------------------------------------
# applying, switching
# ---------------------------------------------------------------------------------------------


def apply_lora(model: nn.Module, rank: int, alpha: float,
               target_modules: TargetModules = ALL_LINEAR,
               exclude_modules: TargetModules | None = None, dropout: float = 0.0, *,
               freeze_base: bool = True, generator: torch.Generator | None = None) -> list[str]:
    """Replace the selected linear layers of ``model`` by `LoRALinear` in place (parameter
    names of the base are unchanged; new ones are ``<module>.lora_A.weight`` /
    ``<module>.lora_B.weight``). ``freeze_base``: every other parameter stops requiring
    gradients. ``generator`` draws A (default: torch's global RNG). Returns the adapted names."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise UserInputError(f"actor_rollout_ref.model.lora_rank={rank!r}: expected an integer "
                             "> 0 (0 turns LoRA off)")
    if not alpha or alpha <= 0:
        raise UserInputError(f"actor_rollout_ref.model.lora_alpha={alpha!r}: expected a number "
                             "> 0 (the update is scaled by lora_alpha / lora_rank)")
    names = [n for n in select_modules(model, target_modules, exclude_modules)
             if not isinstance(model.get_submodule(n), LoRALinear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        setattr(parent, child, LoRALinear(base, rank, alpha, dropout, generator=generator))
    if freeze_base:
        for pname, p in model.named_parameters():
            p.requires_grad_(".lora_A." in pname or ".lora_B." in pname)
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{module name: LoRALinear} of ``model`` (module order)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    for m in lora_modules(model).values():
        m.adapter_enabled = enabled


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside: ``model`` computes with its base weights only (the adapters are skipped)."""
    mods = list(lora_modules(model).values())
    before = [m.adapter_enabled for m in mods]
    for m in mods:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.adapter_enabled = b


# ---------------------------------------------------------------------------------------------
# state
# ---------------------------------------------------------------------------------------------


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state_dict(model: nn.Module, *, peft_names: bool = False) -> dict[str, torch.Tensor]:
    """The adapter tensors (detached): ``<module>.lora_{A,B}.weight`` ([r, in], [out, r]), or
    with ``peft_names`` PEFT's file keys ``base_model.model.<module>.lora_{A,B}.weight``."""
    prefix = PEFT_PREFIX if peft_names else ""
    return {prefix + n: p.detach() for n, p in model.named_parameters() if is_adapter_param(n)}


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> tensor of the model with every enabled adapter folded in (W + (alpha/r) B A),
    in HF state_dict order, tied ``lm_head.weight`` omitted as HF saves it. A plain (not
    distributed) model; the base parameters are not modified."""
    from megarl.models.state_dict_adapter import hf_sort_key, to_hf

    mods = lora_modules(model)
    state = {n: t for n, t in model.state_dict().items() if not is_adapter_param(n)}
    for name, mod in mods.items():
        if mod.adapter_enabled:
            key = f"{name}.weight"
            state[key] = state[key] + mod.delta_weight().to(state[key].dtype)
    ordered = ((n, state[n].detach()) for n in sorted(state, key=hf_sort_key))
    return dict(to_hf(ordered, model.args))


def peft_adapter_config(settings: LoraSettings, target_names: Sequence[str],
                        base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for an adapter on exactly ``target_names`` (full module
    names, so PEFT adapts the same modules whatever ``target_modules`` / ``exclude_modules``
    selected them)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(target_names),
        "exclude_modules": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_peft_adapter(directory: str | os.PathLike, adapter: Mapping[str, torch.Tensor],
                      settings: LoraSettings, *, base_model_name_or_path: str | None = None,
                      dtype: torch.dtype | None = None) -> Path:
    """Write ``adapter`` ({``<module>.lora_{A,B}.weight``: tensor}, `adapter_state_dict`'s
    names) as a PEFT adapter folder: ``adapter_config.json`` + ``adapter_model.safetensors``.
    ``dtype``: cast the tensors (default: as given)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, targets = {}, set()
    for name, t in adapter.items():
        if not is_adapter_param(name):
            raise ValueError(f"{name} is not an adapter tensor (<module>.lora_A/B.weight)")
        targets.add(name.rsplit(".lora_", 1)[0])
        t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
        tensors[PEFT_PREFIX + name] = t
    config = peft_adapter_config(settings, sorted(targets), base_model_name_or_path)
    tmp = directory / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, directory / ADAPTER_WEIGHTS)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def save_merged(model: nn.Module, directory: str | os.PathLike, *,
                source_dir: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
                overwrite: bool = False) -> Path:
    """Save ``model`` with its adapters folded in as a plain HF folder (transformers loads it
    without PEFT)."""
    from megarl.models.hf_io import save_hf_checkpoint
    from megarl.models.loading import hf_config_for

    return save_hf_checkpoint(directory, merged_state_dict(model), hf_config_for(model),
                              source_dir=source_dir, dtype=dtype, overwrite=overwrite)
