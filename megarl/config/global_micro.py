"""verl's deprecated global micro-batch sizes, read as megarl's per-rank sizes.

verl still accepts ``actor_rollout_ref.actor.ppo_micro_batch_size`` and its siblings (the
responses of one forward summed over the data-parallel ranks). Its workers divide the value by
the role's data-parallel size (FSDP: world / Ulysses SP; megatron: world / (TP x PP x CP)),
rounding down, and use the quotient as the ``*_per_gpu`` size; setting both spellings, or a
global size below the data-parallel size (a quotient of 0), is an error there. megarl does the
same, with the data-parallel size of its layout (world / (TP x PP x Ulysses SP) of the role), and
says which per-rank size it chose in a notice.
"""

from __future__ import annotations

from typing import Any

from megarl.config.aliases import get_path, set_path
from megarl.config.provenance import Sources

_ARR = "actor_rollout_ref"
# verl's global key -> (megarl's per-rank key, the parallel layout that sets the divisor)
GLOBAL_MICRO: dict[str, tuple[str, str]] = {
    f"{_ARR}.actor.ppo_micro_batch_size": (f"{_ARR}.actor.ppo_micro_batch_size_per_gpu",
                                           f"{_ARR}.actor.parallel"),
    f"{_ARR}.ref.log_prob_micro_batch_size": (f"{_ARR}.ref.log_prob_micro_batch_size_per_gpu",
                                              f"{_ARR}.actor.parallel"),
    f"{_ARR}.rollout.log_prob_micro_batch_size": (
        f"{_ARR}.rollout.log_prob_micro_batch_size_per_gpu", f"{_ARR}.actor.parallel"),
    "critic.ppo_micro_batch_size": ("critic.ppo_micro_batch_size_per_gpu", "critic.parallel"),
    # verl's critic forward size; megarl's critic has one micro size for both passes
    "critic.forward_micro_batch_size": ("critic.ppo_micro_batch_size_per_gpu", "critic.parallel"),
    "reward_model.micro_batch_size": ("reward_model.micro_batch_size_per_gpu",
                                      "reward_model.parallel"),
}
# the verl spelling of the per-rank key where it differs from megarl's
_VERL_PER_GPU = {"critic.forward_micro_batch_size": "critic.forward_micro_batch_size_per_gpu"}


def data_parallel_size(tree: dict, layout: str) -> tuple[int, str] | None:
    """(data-parallel size, how it was counted) of the layout at ``layout`` (a dotted
    ``*.parallel`` key) in the resolved config ``tree``; None when the sizes are not positive
    integers or do not divide the world (the layout check reports that)."""
    sizes = [get_path(tree, k) for k in ("launch.nnodes", "launch.nproc_per_node")]
    sizes += [get_path(tree, f"{layout}.{k}") for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "ulysses_sequence_parallel_size")]
    sizes.append(get_path(tree, f"{layout}.context_parallel_size", 1))
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        return None
    nnodes, nproc, tp, pp, sp, cp = sizes
    world = nnodes * nproc
    if world % (tp * pp * sp * cp):
        return None
    split = f"TP {tp} x PP {pp} x SP {sp}" + (f" x CP {cp}" if cp > 1 else "")
    return world // (tp * pp * sp * cp), f"world {world} / ({split})"


def convert(values: dict[str, tuple[Any, str]], tree: dict, raw: dict,
            sources: Sources) -> tuple[list[str], list[str]]:
    """Read the global sizes among ``values`` (verl-only keys: {dotted: (value, source)}; the
    ones handled are removed) into their per-rank keys of ``tree`` (the resolved config) and
    ``raw`` (the user's layers merged, which says what was set explicitly); ``sources`` learns
    where each per-rank value came from. Returns (notices, problems), one line each."""
    notices: list[str] = []
    problems: list[str] = []
    chosen: dict[str, tuple[int, str]] = {}  # per-rank key -> (value, from which global key)
    for key in [k for k in GLOBAL_MICRO if k in values]:
        value, source = values.pop(key)
        if value is None:
            continue  # verl's default: unset
        target, layout = GLOBAL_MICRO[key]
        said = f"{key}={value!r} (from {source})"
        own = None if target in chosen else get_path(raw, target)  # set by the user, not by us
        if own is not None:
            spelled = _VERL_PER_GPU.get(key, target)
            problems.append(
                f"{said} and {spelled}={own!r}{sources(target)} are both set: the first is "
                f"verl's deprecated global size of the second; remove {key} (verl refuses both)")
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{said}: must be a positive integer (responses per forward, summed "
                            f"over the data-parallel ranks), or set {target} instead")
            continue
        dp = data_parallel_size(tree, layout)
        if dp is None:
            continue  # the layout itself is reported by the validation
        ranks, counted = dp
        per = value // ranks
        if per < 1:
            problems.append(
                f"{said}: verl's global size is divided over the {ranks} data-parallel ranks "
                f"({counted}), which leaves {value} // {ranks} = 0 responses per rank; set it to "
                f"at least {ranks} (a multiple of {ranks}), or set {target} instead")
            continue
        if target in chosen and chosen[target][0] != per:
            problems.append(
                f"{said} gives {target}={per}, but {chosen[target][1]} gives "
                f"{chosen[target][0]}; megarl's critic has one micro size: set one of them")
            continue
        chosen[target] = (per, key)
        set_path(tree, target, per)
        set_path(raw, target, per)
        sources.source[target] = sources.leaf[target] = source
        rounded = "" if value % ranks == 0 else \
            f", rounded down as verl does: {per * ranks} responses per forward, not {value}"
        notices.append(
            f"{said}: verl's deprecated global size, read as {target}={per} ({value} over "
            f"{ranks} data-parallel ranks: {counted}{rounded})")
    return notices, problems
