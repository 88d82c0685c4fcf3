"""Multi-turn rollouts: turns as session requests vs one ``generate`` per turn, in one run.

Builds the demo's ``grpo_tools`` run (the tool-using policy, the calculator, 64 prompts x 8
trajectories by default) and generates its first training batches with the agent loop twice
per round, alternating the order: on the engine as it is (every trajectory's next turn joins
the running batch when its tool call returns: `megarl.rollout.torch.session`) and behind a
generate-only wrapper (one ``generate`` per turn over every live trajectory). Prints, per
mode, the median seconds of a batch, the decode steps and prefill forwards, and the ratio
turn-by-turn / session (> 1: the session is faster). The trajectories are checked equal.

    OMP_NUM_THREADS=1 python bench/agent_session.py --rounds 3
    OMP_NUM_THREADS=1 python bench/agent_session.py --overrides data.train_batch_size=16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


class TurnByTurn:
    """The engine behind its ``generate`` only."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, sampling, prompt_keys=None):
        return self.engine.generate(prompts, sampling, prompt_keys=prompt_keys)


class Forwards:
    """Counts the model's decode steps and prefill forwards."""

    def __init__(self, model):
        self.decode = self.prefill = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if args[0].shape[1] == 1:
            self.decode += 1
        else:
            self.prefill += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[])
    args = ap.parse_args()

    from megarl.config.loader import resolve_config
    from megarl.trainer import generation as R
    from megarl.trainer.parts import build_run
    from megarl.trainer.producer import SampleProducer
    from megarl.utils import dist as mdist

    torch.set_num_threads(1)
    mdist.init_distributed(torch.device("cpu"))
    cfg = resolve_config("grpo_tools", [f"trainer.default_local_dir={tempfile.mkdtemp()}",
                                        "trainer.logger=[jsonl]", *args.overrides]).config
    parts = build_run(cfg)
    try:
        engine = parts.engine
        counts = Forwards(engine.model)
        producer = SampleProducer(cfg, parts, rewards=None)
        items = [parts.train_ds[i] for i in parts.sampler.next_batch()]
        sampling = producer.sampling(R.sampling_seed(cfg.trainer.seed, 1, 0, R.ROLLOUT_STREAM))
        modes = {"session": engine, "turn_by_turn": TurnByTurn(engine)}
        seconds: dict[str, list[float]] = {m: [] for m in modes}
        steps: dict[str, tuple[int, int]] = {}
        outputs: dict[str, list] = {}
        for rnd in range(args.rounds):
            for name in (list(modes) if rnd % 2 == 0 else list(modes)[::-1]):
                counts.decode = counts.prefill = 0
                t0 = time.perf_counter()
                samples = R.generate(modes[name], items, sampling, group_offset=0,
                                     agent=parts.agent)
                seconds[name].append(time.perf_counter() - t0)
                steps[name] = (counts.decode, counts.prefill)
                outputs[name] = [s.response_ids for s in samples]
        same = outputs["session"] == outputs["turn_by_turn"]
        print(f"{len(items)} prompts x {sampling.n} trajectories, {args.rounds} rounds "
              f"(the same trajectories both ways: {same})")
        print(f"{'mode':<14} {'median s':>9} {'decode steps':>13} {'prefills':>9}")
        for name in modes:
            print(f"{name:<14} {statistics.median(seconds[name]):>9.2f} "
                  f"{steps[name][0]:>13} {steps[name][1]:>9}")
        ratio = statistics.median(seconds["turn_by_turn"]) / statistics.median(seconds["session"])
        print(f"turn_by_turn / session: {ratio:.2f}x")
    finally:
        parts.close()
        mdist.destroy()


if __name__ == "__main__":
    main()
