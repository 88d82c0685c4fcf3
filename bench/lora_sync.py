"""megarl's torch engine with a LoRA actor: merged weights vs the adapters kept unmerged.

    python bench/lora_sync.py [--model embedded://policy] [--rank 8] [--prompts 64] [--n 8]

Per weight version, either
- merged: the engine receives every weight with ``W + (alpha / r) B A`` folded in
  (``update_weights`` of `megarl.models.lora.merged_state_dict`'s stream) and generates with
  plain linears; or
- unmerged: the engine's model carries `LoRALinear` adapters (`apply_lora`) and receives A and B
  only (copied into its adapters), paying the adapter matmuls in every forward.
Printed (JSON): bytes per sync, seconds per sync and per ``generate`` of ``--prompts`` x ``--n``
sampled responses of up to ``--max-new`` tokens (the demo's shape), medians of ``--repeats``
(the two paths interleaved);
and whether both paths produce the same greedy tokens (they must) and tokens other than the
base model's (the adapter matters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded://policy")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from megarl.data import resolve_path
    from megarl.models.loading import load_model
    from megarl.models.lora import adapter_state_dict, apply_lora, lora_modules, merged_state_dict
    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.torch import TorchRolloutEngine

    torch.manual_seed(0)
    path = resolve_path(args.model)
    actor = load_model(path, head="lm", dtype=torch.float32)
    apply_lora(actor, args.rank, 2.0 * args.rank)
    g = torch.Generator().manual_seed(1)
    for m in lora_modules(actor).values():  # a trained adapter: B != 0
        m.lora_B.weight.data.normal_(0.0, 0.02, generator=g)
    adapter = adapter_state_dict(actor)
    merged = merged_state_dict(actor)

    plain = TorchRolloutEngine.from_pretrained(path)
    unmerged = TorchRolloutEngine.from_pretrained(path)
    apply_lora(unmerged.model, args.rank, 2.0 * args.rank)
    unmerged_params = dict(unmerged.model.named_parameters())

    def sync_merged() -> None:
        plain.update_weights(iter(merged.items()))

    @torch.no_grad()
    def sync_unmerged() -> None:
        for name, t in adapter.items():
            unmerged_params[name].copy_(t)

    prompts = [[1, *torch.randint(3, 100, (24,), generator=g).tolist()]
               for _ in range(args.prompts)]
    sampled = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new,
                             ignore_eos=True, seed=0)
    greedy = SamplingParams(greedy=True, max_new_tokens=16, ignore_eos=True)

    base_tokens = [c.token_ids for c in plain.generate(prompts[:8], greedy)]
    out = {"model": args.model, "rank": args.rank, "threads": torch.get_num_threads()}

    def once(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    paths = {
        "merged": (plain, sync_merged,
                   sum(t.numel() * t.element_size() for t in merged.values())),
        "unmerged": (unmerged, sync_unmerged,
                     sum(t.numel() * t.element_size() for t in adapter.values())),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"sync_s": [], "generate_s": []}
                                                 for k in paths}
    for _ in range(args.repeats):  # interleaved, so load on a shared machine hits both alike
        for name, (engine, sync, _) in paths.items():
            times[name]["sync_s"].append(once(sync))
            times[name]["generate_s"].append(once(lambda e=engine: e.generate(prompts, sampled)))
    for name, (_, _, nbytes) in paths.items():
        out[name] = {"sync_bytes": nbytes,
                     **{k: statistics.median(v) for k, v in times[name].items()}}
    same = ([c.token_ids for c in plain.generate(prompts[:8], greedy)]
            == [c.token_ids for c in unmerged.generate(prompts[:8], greedy)])
    out["same_greedy_tokens"] = same
    out["adapter_changes_tokens"] = base_tokens != [c.token_ids for c in plain.generate(
        prompts[:8], greedy)]
    step = {k: out[k]["sync_s"] + out[k]["generate_s"] for k in ("merged", "unmerged")}
    out["faster"] = min(step, key=step.get)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
