"""What both backends check before replaying an MoE policy's recorded routing (R3)."""

from __future__ import annotations

from typing import Any

from megarl.errors import UserInputError

REPLAY_KEY = "actor_rollout_ref.actor.router_replay.mode"


def check_router_replay(args: Any, role: str) -> None:
    """Refuse routing replay where it cannot apply, naming the key to change.

    args: the model's `megarl.models.args.ModelArgs`; role: the backend's role."""
    if not args.is_moe:
        raise UserInputError(f"{REPLAY_KEY}=R3 needs a mixture-of-experts policy; this model is "
                             f"dense (set {REPLAY_KEY}=disabled)")
    if role not in ("actor", "ref"):
        raise UserInputError(f"routing replay applies to the policy (actor / ref), not {role}")
