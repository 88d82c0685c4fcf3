"""The settings of one training role, the same for both backends (`RoleSettings`), and the
token-budget rule of micro-batches (`micro_batch_tokens`). They are made from the project
config where the run is built (`megarl.trainer.settings.role_settings`, which says what each
field reads); the backends map them onto their own constructors (`megarl.backends.torch.config`,
`megarl.backends.megatron.config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.backends.optim_settings import OptimSettings
from megarl.backends.protocol import TRAINABLE_ROLES
from megarl.models.lora import LoraSettings


@dataclass(frozen=True)
class MicroBatching:
    """How a rank's rows are cut for the no-grad forwards (logprobs, values, token scores)."""

    dynamic: bool  # pack by a token budget (verl's use_dynamic_bsz)
    # TOKENS per micro-batch, used when dynamic: the role's per-GPU budget times the ranks that
    # split one sequence (`micro_batch_tokens`)
    max_tokens: int | None
    rows: int | None  # RESPONSES per forward, used when not dynamic


@dataclass(frozen=True)
class Parallel:
    """The role's ``parallel`` block (sizes in ranks)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # interleaved pipeline stages per rank (megatron only)
    sp: bool = False  # sequence parallelism inside TP
    dp_shard: int = -1  # torch: FSDP shard group inside DP (-1: all DP ranks)
    ulysses: int = 1  # torch: Ulysses sequence-parallel size
    cp: int = 1  # megatron: context-parallel size


@dataclass(frozen=True)
class Kernels:
    """The LM head's logprob / entropy path (``actor_rollout_ref.model``)."""

    fused: bool = True  # megarl_kernels.linear_logprob_entropy, else the naive path
    impl: str = "auto"  # auto | torch | triton (torch backend)
    chunk_size: int | None = None  # tokens per chunk of the fused path (torch backend)


@dataclass(frozen=True)
class RoleSettings:
    """What both backends take for one role, read from the project config by
    `megarl.trainer.settings.role_settings`.

    megatron: the role's ``megatron`` config block (critic: its own; actor, ref, prm: the
    actor's), read only by the megatron backend."""

    role: str
    model_path: str
    dtype: str  # fp32 | bf16: the dtype the role's model computes in
    parallel: Parallel
    micro: MicroBatching
    kernels: Kernels
    seed: int
    optim: OptimSettings | None = None  # actor and critic
    activation_checkpointing: bool = False  # recompute each block in backward
    router_replay: str = "disabled"  # the actor's MoE routing replay: disabled | R2 | R3
    megatron: Any = None
    # verl's model.override_config block of the role's model (merged into its config.json,
    # `megarl.models.overrides`) and its config key
    override_config: dict[str, Any] | None = None
    override_key: str = "actor_rollout_ref.model.override_config"
    lora: LoraSettings | None = None  # the actor's adapters (`lora_settings`)
    device: str = "auto"  # trainer.device: auto | cpu | cuda (`megarl.utils.dist.resolve_device`)
    param_dtype: str | None = None  # torch backend: the role's parallel.param_dtype

    @property
    def trainable(self) -> bool:
        return self.role in TRAINABLE_ROLES


def sequence_split(par: Any) -> int:
    """Ranks one sequence is split over in a role's ``parallel`` block: Ulysses x CP."""
    return int(par.ulysses_sequence_parallel_size) * int(par.context_parallel_size)


def micro_batch_tokens(tokens_per_gpu: int | None, par: Any) -> int | None:
    """A micro-batch's token budget from verl's per-GPU one (``*_max_token_len_per_gpu``):
    times the ranks that split each sequence (`sequence_split`), None stays None."""
    return None if tokens_per_gpu is None else int(tokens_per_gpu) * sequence_split(par)


