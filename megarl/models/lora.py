"""LoRA (low-rank adapters) for `megarl.models.Transformer`, with PEFT's semantics and files.

A targeted ``nn.Linear`` becomes a `LoRALinear`: the same ``weight`` / ``bias`` Parameters
(frozen, HF names unchanged) plus ``lora_A`` [r, in] and ``lora_B`` [out, r]:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

``lora_A`` is drawn as PEFT draws it (``kaiming_uniform_(a=sqrt(5))``, nn.Linear's default),
``lora_B`` starts at zero, so a fresh adapter leaves the model's outputs unchanged. verl's
megatron LoRA block names other draws (``lora_A_init_method`` / ``lora_B_init_method``, the
names of Megatron-Bridge's ``get_init_fn``): `init_factor_` implements them.

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
from dataclasses import asdict, dataclass
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

# Megatron-Bridge's adapter initialisations (megatron.bridge.peft.utils.get_init_fn), by name
LORA_INITS = ("xavier", "kaiming", "normal", "zero")


def init_factor_(tensor: torch.Tensor, method: str,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill one adapter factor ([out, in]: A is [r, in], B is [out, r]) in place:
    ``xavier``: normal, std sqrt(2 / (in + out)) (``xavier_normal_``); ``kaiming``:
    ``kaiming_uniform_(a=sqrt(5))`` (PEFT's and nn.Linear's draw, bound sqrt(1 / in));
    ``normal``: normal, std 0.2; ``zero``: zeros."""
    with torch.no_grad():
        if method == "xavier":
            return nn.init.xavier_normal_(tensor, generator=generator)
        if method == "kaiming":
            return nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        if method == "normal":
            return nn.init.normal_(tensor, 0.0, 0.2, generator=generator)
        if method == "zero":
            return nn.init.zeros_(tensor)
    raise UserInputError(f"LoRA init method {method!r}: expected one of {', '.join(LORA_INITS)}")


@dataclass(frozen=True)
class LoraSettings:
    """One adapter's shape and placement (verl: ``actor_rollout_ref.model.lora_rank`` etc.).

    rank:    r, the inner dimension of B A (> 0).
    alpha:   scale numerator: the update is (alpha / rank) B A.
    target_modules / exclude_modules: see the module docstring.
    dropout: probability of zeroing an element in training (0 = none, verl's default); the
             kept ones are scaled by 1 / (1 - dropout). Rollouts, old and reference logprobs
             and exports run without it (the model in eval mode).
    dropout_position: "pre" drops the adapter's input x (PEFT's and Megatron-Bridge's
             default), "post" its output B A x (Megatron-Bridge's other choice).
    init_a / init_b: how a fresh A / B is drawn (`LORA_INITS`; default PEFT's: kaiming, zero).
    adapter_path: a PEFT adapter folder the adapters start from instead (`read_peft_adapter`).
    """

    rank: int
    alpha: float
    target_modules: TargetModules = ALL_LINEAR
    exclude_modules: TargetModules | None = None
    dropout: float = 0.0
    dropout_position: str = "pre"
    init_a: str = "kaiming"
    init_b: str = "zero"
    adapter_path: str | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


DROPOUT_POSITIONS = ("pre", "post")
# how the adapters started and how they are regularised in training: not part of what a
# checkpoint's adapters are (a run resumes or continues them at another dropout)
START_FIELDS = ("init_a", "init_b", "adapter_path")
TRAINING_FIELDS = ("dropout", "dropout_position")


def settings_meta(settings: LoraSettings | None) -> dict[str, Any] | None:
    """``settings`` as a checkpoint records and compares them (JSON types: lists, not tuples),
    without `START_FIELDS` and `TRAINING_FIELDS`; None without LoRA."""
    if settings is None:
        return None
    return adapter_identity(asdict(settings))


def adapter_identity(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """What of a checkpoint's recorded LoRA settings ``meta`` defines its adapters (older
    checkpoints also recorded the dropout): the settings two runs must share to exchange
    adapters."""
    if meta is None:
        return None
    kept = {k: v for k, v in meta.items() if k not in START_FIELDS + TRAINING_FIELDS}
    return json.loads(json.dumps(kept))


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (its own ``weight`` and ``bias``, shared with the layer it replaces)
    plus a rank-r adapter. Input [..., in] -> output [..., out] in the input's dtype.

    ``adapter_enabled`` False: the plain linear (the reference model of an RL run)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 *, generator: torch.Generator | None = None, init_a: str = "kaiming",
                 init_b: str = "zero", dropout_position: str = "pre") -> None:
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
        # PEFT's module name; applied to the input ("pre") or to B A x ("post")
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if dropout_position not in DROPOUT_POSITIONS:
            raise ValueError(f"LoRA dropout_position must be one of {DROPOUT_POSITIONS}, got "
                             f"{dropout_position!r}")
        self.dropout_post = dropout_position == "post"
        self.adapter_enabled = True
        self.reset_lora_parameters(generator, init_a, init_b)

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None,
                              init_a: str = "kaiming", init_b: str = "zero") -> None:
        """A, then B, drawn by `init_factor_` (default PEFT's: A kaiming-uniform with
        a = sqrt(5), B zeros)."""
        if self.lora_A.weight.device.type != "meta":
            init_factor_(self.lora_A.weight, init_a, generator)
            init_factor_(self.lora_B.weight, init_b, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return y
        if self.dropout_post:
            return y + self.lora_dropout(self.lora_B(self.lora_A(x))) * self.scaling
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
               freeze_base: bool = True, generator: torch.Generator | None = None,
               init_a: str = "kaiming", init_b: str = "zero",
               dropout_position: str = "pre") -> list[str]:
    """Replace the selected linear layers of ``model`` by `LoRALinear` in place (parameter
    names of the base are unchanged; new ones are ``<module>.lora_A.weight`` /
    ``<module>.lora_B.weight``). ``freeze_base``: every other parameter stops requiring
    gradients. ``generator`` draws A then B of each module in module order (default: torch's
    global RNG), by ``init_a`` / ``init_b`` (`init_factor_`). ``dropout`` (in train mode
    only) at ``dropout_position``. Returns the adapted names."""
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
        setattr(parent, child, LoRALinear(base, rank, alpha, dropout, generator=generator,
                                          init_a=init_a, init_b=init_b,
                                          dropout_position=dropout_position))
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


# ---------------------------------------------------------------------------------------------
# starting from a saved PEFT adapter (verl: actor_rollout_ref.model.lora_adapter_path)
# ---------------------------------------------------------------------------------------------

ADAPTER_PATH_KEY = "actor_rollout_ref.model.lora_adapter_path"
# adapter_config.json fields megarl's adapters cannot reproduce, with the value that is fine.
# Not among them: lora_dropout, a training-time regulariser that is no part of the adapter's
# function (PEFT applies it in train mode only; rollouts and logprobs run without it): an
# adapter saved with dropout starts a run like any other, trained at the run's own dropout.
_PEFT_PLAIN = {"use_dora": False, "use_rslora": False, "bias": "none", "lora_bias": False,
               "fan_in_fan_out": False,
               "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
               "layers_to_transform": None}


def _read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    folder = Path(os.path.expanduser(str(path)))
    config_file, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for f in (config_file, weights):
        if not f.is_file():
            raise UserInputError(f"{ADAPTER_PATH_KEY}={str(path)!r}: {f} does not exist; give a "
                                 f"PEFT adapter folder ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}, "
                                 "as PeftModel.save_pretrained writes it)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise UserInputError(f"{ADAPTER_PATH_KEY}={str(path)!r}: {config_file} is not JSON "
                             f"({e})") from e
    if config.get("peft_type", "LORA") != "LORA" or not isinstance(config.get("r"), int):
        raise UserInputError(f"{ADAPTER_PATH_KEY}={str(path)!r}: not a LoRA adapter (peft_type="
                             f"{config.get('peft_type')!r}, r={config.get('r')!r})")
    for field_name, plain in _PEFT_PLAIN.items():
        value = config.get(field_name, plain)
        if value != plain and not (plain in (None, {}) and not value):
            raise UserInputError(
                f"{ADAPTER_PATH_KEY}={str(path)!r}: the adapter has {field_name}={value!r}; "
                f"megarl trains plain LoRA adapters ({field_name}={plain!r})")
    return config


def adapter_settings(path: str | os.PathLike, rank: int, alpha: float) -> LoraSettings:
    """The adapters a PEFT folder at ``path`` describes (rank ``r``, ``lora_alpha``, its
    ``target_modules`` / ``exclude_modules``), starting from its tensors. As verl, the folder
    decides when ``rank`` (the config's lora_rank) is 0; a config rank > 0 must name the same
    rank and ``alpha`` the same alpha (UserInputError naming the key and both values)."""
    config = _read_adapter_config(path)
    r, a = config["r"], config.get("lora_alpha", 8)
    if rank and rank != r:
        raise UserInputError(f"actor_rollout_ref.model.lora_rank={rank} but the adapter at "
                             f"{ADAPTER_PATH_KEY}={str(path)!r} has r={r}: set lora_rank={r} "
                             "(or 0: the adapter's)")
    if rank and float(alpha) != float(a):
        raise UserInputError(f"actor_rollout_ref.model.lora_alpha={alpha} but the adapter at "
                             f"{ADAPTER_PATH_KEY}={str(path)!r} has lora_alpha={a}: set "
                             f"lora_alpha={a} (or lora_rank=0: the adapter's rank and alpha)")
    target = config.get("target_modules") or ALL_LINEAR
    exclude = config.get("exclude_modules") or None
    return LoraSettings(rank=r, alpha=float(a),
                        target_modules=target if isinstance(target, str) else sorted(target),
                        exclude_modules=(exclude if exclude is None or isinstance(exclude, str)
                                         else sorted(exclude)),
                        adapter_path=str(path))


def read_adapter_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """{``<module>.lora_{A,B}.weight``: tensor} of a PEFT folder's ``adapter_model.safetensors``
    (PEFT's ``base_model.model.`` prefix removed); A [r, in], B [out, r], as saved."""
    from safetensors.torch import load_file

    folder = Path(os.path.expanduser(str(path)))
    raw = load_file(str(folder / ADAPTER_WEIGHTS))
    out = {}
    for name, t in raw.items():
        short = name.removeprefix(PEFT_PREFIX)
        if not is_adapter_param(short) or not short.endswith(".weight"):
            raise UserInputError(f"{ADAPTER_PATH_KEY}={str(path)!r}: {name} is not a LoRA "
                                 "linear factor (<module>.lora_A/B.weight); megarl adapts "
                                 "linear layers only")
        out[short] = t
    return out


def check_adapter_names(path: str | os.PathLike, given: Sequence[str],
                        want: Sequence[str]) -> None:
    """UserInputError unless the folder's tensors (``given``) are exactly the adapters this
    model built (``want``): the folder was saved for another model or other modules."""
    missing, unexpected = sorted(set(want) - set(given)), sorted(set(given) - set(want))
    if missing or unexpected:
        raise UserInputError(
            f"{ADAPTER_PATH_KEY}={str(path)!r}: the adapter's tensors do not match the model's "
            f"adapted modules (missing {missing[:3]}, unexpected {unexpected[:3]}); the folder "
            "must hold a LoRA adapter of this model (actor_rollout_ref.model.path)")


@torch.no_grad()
def load_adapter_into(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy a PEFT folder's A / B into ``model``'s `LoRALinear` adapters (every one; shapes
    must match)."""
    tensors = read_adapter_tensors(path)
    params = dict(adapter_state_dict(model))
    check_adapter_names(path, list(tensors), list(params))
    for name, t in tensors.items():
        p = model.get_parameter(name)
        if tuple(p.shape) != tuple(t.shape):
            raise UserInputError(f"{ADAPTER_PATH_KEY}={str(path)!r}: {name} has shape "
                                 f"{tuple(t.shape)}, the model's is {tuple(p.shape)}")
        p.copy_(t.to(p.dtype))
