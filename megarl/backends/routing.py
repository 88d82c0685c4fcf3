"""What both backends check before replaying an MoE policy's routing: the rollout engine's
recorded experts (R3) or those the trainer's own old-logprob pass chose (R2)."""

from __future__ import annotations

from typing import Any

from megarl.errors import UserInputError

REPLAY_KEY = "actor_rollout_ref.actor.router_replay.mode"
REPLAY_MODES = ("disabled", "R2", "R3")


def replay_mode(value: bool | str) -> str:
    """The mode of a backend's ``router_replay`` argument: False or "disabled" -> "disabled",
    True -> "R3" (the rollout engine's routing), "R2" / "R3" as given; UserInputError naming
    the key otherwise."""
    if value is True:
        return "R3"
    if value is False or value is None:
        return "disabled"
    if value not in REPLAY_MODES:
        raise UserInputError(f"{REPLAY_KEY}={value!r}: expected one of {list(REPLAY_MODES)}")
    return str(value)


def check_router_replay(args: Any, role: str, mode: str = "R3") -> None:
    """Refuse routing replay where it cannot apply, naming the key to change.

    args: the model's `megarl.models.args.ModelArgs`; role: the backend's role; mode: R2 | R3."""
    if not args.is_moe:
        raise UserInputError(f"{REPLAY_KEY}={mode} needs a mixture-of-experts policy; this model "
                             f"is dense (set {REPLAY_KEY}=disabled)")
    if role not in ("actor", "ref"):
        raise UserInputError(f"routing replay applies to the policy (actor / ref), not {role}")


def check_r2_layout(args: Any, *, pp: int, sp: int) -> None:
    """R2's recording pass of the torch backend gathers each row's routing from the rank that
    ran it: refuse layouts where one rank sees only some layers (pipeline stages) or some
    tokens (Ulysses)."""
    if not args.is_moe:
        raise UserInputError(f"{REPLAY_KEY}=R2 needs a mixture-of-experts policy; this model is "
                             f"dense (set {REPLAY_KEY}=disabled)")
    if pp > 1 or sp > 1:
        raise UserInputError(
            f"{REPLAY_KEY}=R2 on the torch backend records the routing without pipeline or "
            "Ulysses sequence parallelism; set actor_rollout_ref.actor.parallel."
            "pipeline_model_parallel_size=1 and ulysses_sequence_parallel_size=1, use "
            f"strategy=megatron, or {REPLAY_KEY}=R3")

