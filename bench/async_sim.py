"""A small simulator of the three rollout schedules, fed with measured costs: checked against
`bench/async_modes.py`'s measurement on 2 cores, then asked what a larger case wants.

The model (every number a cost measured or a stated assumption, nothing fitted to the answer):

- an engine decodes its active sequences together, one token each per step; a step of b
  sequences whose longest context is c tokens costs ``d0 + d1 b + d2 b c`` seconds (megarl's
  engine attends over the longest context of the step; a paged engine over each sequence's
  own: ``d2`` x the sum of contexts), plus ``p`` per prompt token prefilled; a sequence joins at
  the next step with a free slot (``slots``), the worker keeps up to ``capacity`` in flight;
- a learner step costs ``t0 + t1 x tokens`` (prompt and response tokens of its batch: the
  old-logprob, reference and update passes, rewards);
- response lengths are drawn (seeded) from the workload's distribution;
- synchronous: generate the step's batch, then train it, on one device set; one-step-off: the
  engine generates batch k + s while the trainer trains batch k (a batch waits for the
  weights it must be sampled with); fully async: verl's window rule (at most R x T x (1 + s)
  prompts out per sync window of T steps), the trainer takes the first R prompts whose n
  samples are back, a sync every T steps: without partial rollout the worker stops admitting
  until its running requests end, then swaps; with it, it swaps at its next step and
  recomputes the running sequences' cache (a prefill of their tokens).

    # the 2-core check: measure the engine here, read the trainer's cost and the modes'
    # samples/s from an async_modes run on the same workload
    OMP_NUM_THREADS=1 python bench/async_sim.py --measured async_modes.json
    # the larger case only (its assumptions printed)
    python bench/async_sim.py --plan
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass
class EngineCost:
    """Seconds of one decode step: d0 + d1 b + d2 b c_max (``longest``) or d2 x the sum of
    the contexts (not ``longest``); ``p``: seconds per prompt token prefilled."""

    d0: float
    d1: float
    d2: float
    p: float
    longest: bool = True

    def decode(self, contexts: np.ndarray) -> float:
        if not len(contexts):
            return 0.0
        attend = len(contexts) * contexts.max() if self.longest else contexts.sum()
        return self.d0 + self.d1 * len(contexts) + self.d2 * float(attend)


@dataclass
class TrainCost:
    """Seconds of one learner step: t0 + t1 x the batch's tokens."""

    t0: float
    t1: float

    def step(self, tokens: float) -> float:
        return self.t0 + self.t1 * tokens


@dataclass
class Workload:
    """R prompts x n samples a step, prompt length fixed, response lengths from ``lengths``."""

    prompts: int
    n: int
    prompt_len: int
    lengths: LengthSampler
    steps: int
    warmup: int


@dataclass
class LengthSampler:
    """Geometric lengths (a response ends at each token with probability ``stop_p``) capped at
    ``max_len`` (the bench's random policy), or log-normal ones of median ``median`` and spread
    ``sigma`` capped at ``max_len``."""

    max_len: int
    stop_p: float | None = None
    median: float | None = None
    sigma: float | None = None
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def draw(self, k: int) -> np.ndarray:
        if self.stop_p is not None:
            out = self.rng.geometric(self.stop_p, k)
        else:
            out = np.ceil(self.median * np.exp(self.sigma * self.rng.standard_normal(k)))
        return np.clip(out, 1, self.max_len).astype(np.int64)


# --------------------------------------------------------------------------- the schedules
class Engine:
    """One engine's continuous batching, stepped in simulated time."""

    def __init__(self, cost: EngineCost, slots: int, prompt_len: int) -> None:
        self.cost, self.slots, self.prompt_len = cost, slots, prompt_len
        self.waiting: deque = deque()  # (request id, length)
        self.ids: list = []
        self.left = np.zeros(0, dtype=np.int64)  # tokens still to sample per active sequence
        self.done = np.zeros(0, dtype=np.int64)  # tokens sampled per active sequence
        self.hold = False  # admit nothing (a drain before new weights)
        self.finished: list = []  # the ids the last step finished

    @property
    def active(self) -> int:
        return len(self.ids)

    def step(self) -> tuple[float, list]:
        """One scheduling step: (seconds, ids of the sequences finished in it)."""
        secs = 0.0
        if not self.hold and self.waiting and self.active < self.slots:
            new = [self.waiting.popleft()
                   for _ in range(min(self.slots - self.active, len(self.waiting)))]
            secs += self.cost.p * self.prompt_len * len(new)
            self.ids += [i for i, _ in new]
            self.left = np.concatenate([self.left, [n for _, n in new]])
            self.done = np.concatenate([self.done, np.zeros(len(new), dtype=np.int64)])
        if not self.ids:
            return secs, []
        secs += self.cost.decode(self.prompt_len + self.done)
        self.left -= 1
        self.done += 1
        fin = self.left <= 0
        out = [i for i, f in zip(self.ids, fin) if f]
        if out:
            keep = ~fin
            self.ids = [i for i, k in zip(self.ids, keep) if k]
            self.left, self.done = self.left[keep], self.done[keep]
        return secs, out

    def refill_cost(self) -> float:
        """A partial rollout's swap: the running sequences' prompts and tokens prefilled."""
        return self.cost.p * float((self.prompt_len + self.done).sum())

    def generate(self, lengths: np.ndarray) -> float:
        """Seconds to generate a whole batch of ``lengths`` from an empty engine."""
        self.waiting.extend(enumerate(lengths.tolist()))
        total = 0.0
        while self.waiting or self.ids:
            secs, _ = self.step()
            total += secs
        return total


def batch_tokens(w: Workload, lengths: np.ndarray) -> float:
    return float(len(lengths) * w.prompt_len + lengths.sum())


def simulate_synchronous(w: Workload, eng: EngineCost, train: TrainCost, slots: int) -> float:
    """Samples per second: generate, then train, one after the other."""
    clock, kept = 0.0, 0
    for step in range(1, w.steps + 1):
        lengths = w.lengths.draw(w.prompts * w.n)
        secs = Engine(eng, slots, w.prompt_len).generate(lengths)
        secs += train.step(batch_tokens(w, lengths))
        if step > w.warmup:
            clock += secs
            kept += len(lengths)
    return kept / clock


def simulate_one_step_off(w: Workload, eng: EngineCost, train: TrainCost, slots: int,
                          staleness: int = 1) -> float:
    """Samples per second: the engine (devices of its own) generates batch k while the trainer
    trains earlier ones; batch k needs the weights of step k - 1 - staleness."""
    gen_end: dict[int, float] = {}
    train_end: dict[int, float] = {0: 0.0}
    engine_free = 0.0
    tokens: dict[int, float] = {}
    for k in range(1, w.steps + 1):
        start = max(engine_free, train_end.get(k - 1 - staleness, 0.0))
        lengths = w.lengths.draw(w.prompts * w.n)
        gen_end[k] = engine_free = start + Engine(eng, slots, w.prompt_len).generate(lengths)
        tokens[k] = batch_tokens(w, lengths)
        train_end[k] = max(train_end[k - 1], gen_end[k]) + train.step(tokens[k])
    span = train_end[w.steps] - train_end[w.warmup]
    return (w.steps - w.warmup) * w.prompts * w.n / span


def simulate_fully_async(w: Workload, eng: EngineCost, train: TrainCost, *, workers: int,
                         slots: int, capacity: int, staleness: float, sync_every: int,
                         partial: bool, sync_s: float = 0.0) -> dict[str, float]:
    """Samples per second, the trainer's wait share and the mean version lag (per sample) of
    ``workers`` rollout engines beside a trainer (module doc), as a discrete-event run: a
    worker's step delivers its finished samples when it ends; the trainer starts a step when
    it is free and R prompts are ready; a sync at the end of every T-th step opens the next
    window and reaches each worker at its next step."""
    per_window = int(w.prompts * sync_every * (1 + staleness))
    total_prompts = w.prompts * w.steps
    engines = [Engine(eng, slots, w.prompt_len) for _ in range(workers)]
    runs = [0] * workers  # the version each worker runs
    load = [0] * workers  # sequences in flight per worker
    idle = set(range(workers))
    events: list = []  # (time, order, kind, payload)
    order = 0

    def push(t: float, kind: str, payload) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, payload))

    st = {"issued": 0, "taken": 0, "base": 0, "version": 0, "step": 0, "busy": False,
          "free_at": 0.0}
    left_of: dict[int, int] = {}
    tokens_of: dict[int, float] = {}
    version_of: dict[int, int] = {}
    ready: deque = deque()
    step_end: dict[int, float] = {0: 0.0}
    waits: dict[int, float] = {}
    lags: list[int] = []

    def hand_out(t: float) -> None:
        while st["issued"] - st["base"] < per_window and st["issued"] < total_prompts:
            wi = min(range(workers), key=lambda i: load[i])
            if load[wi] + w.n > capacity:
                return
            p = st["issued"]
            st["issued"] += 1
            lengths = w.lengths.draw(w.n)
            left_of[p], tokens_of[p] = w.n, batch_tokens(w, lengths)
            version_of[p] = -1  # set when its first sample is admitted
            engines[wi].waiting.extend(((p, s), int(n)) for s, n in enumerate(lengths))
            load[wi] += w.n
            if wi in idle:
                idle.discard(wi)
                push(t, "step", wi)

    def try_train(t: float) -> None:
        if st["busy"] or len(ready) < w.prompts:
            return
        batch = [ready.popleft() for _ in range(w.prompts)]
        st["busy"] = True
        st["taken"] += w.prompts
        waits[st["step"] + 1] = t - st["free_at"]
        lags.extend(st["version"] - version_of[p] for p in batch)
        sync = (st["step"] + 1) % sync_every == 0
        push(t + train.step(sum(tokens_of[p] for p in batch)) + (sync_s if sync else 0.0),
             "trained", sync)

    hand_out(0.0)
    while st["step"] < w.steps:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "trained":
            st["step"] += 1
            st["busy"], st["free_at"] = False, t
            step_end[st["step"]] = t
            if payload:  # a sync: new weights, the next window
                st["version"] += 1
                st["base"] = st["taken"]
                for wi in list(idle):
                    idle.discard(wi)
                    push(t, "step", wi)
            hand_out(t)
            try_train(t)
            continue
        wi = payload
        e = engines[wi]
        if kind == "done":  # a worker's step ended: its samples are back
            for p, _ in e.finished:
                left_of[p] -= 1
                load[wi] -= 1
                if left_of[p] == 0:
                    ready.append(p)
            try_train(t)
            hand_out(t)
        secs = 0.0
        if runs[wi] < st["version"]:  # new weights reached this worker
            if partial:
                secs += e.refill_cost()
                runs[wi] = st["version"]
            elif not e.ids:
                runs[wi] = st["version"]
        e.hold = runs[wi] < st["version"]  # draining: admit nothing until it swaps
        before = set(e.ids)
        step_s, e.finished = e.step()
        for p, _ in set(e.ids) - before:
            if version_of[p] < 0:
                version_of[p] = runs[wi]
        if step_s == 0.0 and secs == 0.0:
            idle.add(wi)
            continue
        push(t + secs + step_s, "done", wi)
    span = step_end[w.steps] - step_end[w.warmup]
    kept = (w.steps - w.warmup) * w.prompts * w.n
    wait = sum(v for k, v in waits.items() if k > w.warmup)
    return {"samples_per_s": kept / span, "trainer_wait": wait / span,
            "lag_mean": statistics.mean(lags)}


# --------------------------------------------------------------------------- measuring
def measure_engine(policy: Path, batches=(1, 16, 64, 256), tokens: int = 160) -> EngineCost:
    """d0, d1, d2 by least squares over decode steps of megarl's engine on ``policy`` (b
    sequences from a 24-token prompt, contexts 24..24 + ``tokens``); p from the prefills."""
    import torch

    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.torch import TorchRolloutEngine

    torch.set_num_threads(1)
    engine = TorchRolloutEngine.from_pretrained(str(policy), max_num_seqs=max(batches),
                                                tokenizer=None)
    sp = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    rows, secs, prefill = [], [], []
    prompt = list(range(3, 27))
    for b in batches:
        session = engine.open_session(sp, max_len=len(prompt) + tokens)
        for i in range(b):
            session.submit(prompt, prompt_key=i, seed=0)
        t = time.perf_counter()
        session.step()  # the prefill (and its first token)
        prefill.append((time.perf_counter() - t) / (b * len(prompt)))
        ctx = len(prompt)
        while session.busy:
            t = time.perf_counter()
            session.step()
            secs.append(time.perf_counter() - t)
            ctx += 1
            rows.append([1.0, b, b * ctx])
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(secs), rcond=None)
    d0, d1, d2 = (max(float(c), 0.0) for c in coef)
    return EngineCost(d0, d1, d2, p=statistics.median(prefill))


def train_cost(runs: list[dict]) -> TrainCost:
    """t0, t1 by least squares over the runs' kept steps: step seconds less ``timing_s/gen``
    (the generation in the synchronous loop, the wait for samples in the asynchronous ones)
    against the step's tokens."""
    x = [tok for r in runs for tok in r["tokens"]]
    y = [s - g for r in runs for s, g in zip(r["step_s"], r["gen_s"])]
    t1, t0 = np.polyfit(x, y, 1)
    if t0 < 0:  # too little spread in the tokens to place the intercept: through 0
        t0, t1 = 0.0, sum(y) / sum(x)
    return TrainCost(float(t0), float(t1))


def check_two_cores(measured: Path) -> None:
    """The bench's modes, simulated with this machine's engine costs and the learner's costs
    of the bench's runs, against what the bench measured: the synchronous loop's learner cost
    from its own runs (its step also loads the weights into the engine it shares the core
    with), the asynchronous modes' from the one-step-off runs (the learner alone on its core,
    barely waiting), so the fully async predictions test the schedule model alone."""
    from bench.async_modes import random_assets

    data = json.loads(measured.read_text())
    args, modes = data["args"], data["modes"]
    assets = random_assets(Path(tempfile.mkdtemp(prefix="megarl_async_sim_")))
    eng = measure_engine(assets / "policy")
    if "synchronous" not in modes or "one-step-off" not in modes:
        sys.exit("--measured needs an async_modes.py run with the synchronous and one-step-off "
                 "modes (the learner's costs are read from them)")
    train = train_cost(modes["synchronous"])
    alone = train_cost(modes["one-step-off"])
    vocab = json.loads((assets / "policy" / "config.json").read_text())["vocab_size"]
    stops = int(args["stops"]) + 1  # the extra stop tokens and EOS
    prompt_len = 30  # the demo's chat-templated prompts: 24-36 tokens

    def workload(seed: int) -> Workload:
        return Workload(int(args["prompts"]), int(args["n"]), prompt_len,
                        LengthSampler(int(args["max_len"]), stop_p=stops / vocab,
                                      rng=np.random.default_rng(seed)),
                        int(args["steps"]), int(args["warmup"]))

    slots = 512  # the demo's max_num_seqs, unless the run set another
    for o in args.get("overrides") or []:
        if o.startswith("actor_rollout_ref.rollout.max_num_seqs="):
            slots = int(o.split("=", 1)[1])
    sims = {
        "synchronous": lambda s: simulate_synchronous(workload(s), eng, train, slots),
        "one-step-off": lambda s: simulate_one_step_off(workload(s), eng, alone, slots),
        "fully async": lambda s: simulate_fully_async(
            workload(s), eng, alone, workers=1, slots=slots, capacity=10**9,
            staleness=float(args["staleness"]), sync_every=int(args["sync_every"]),
            partial=False)["samples_per_s"],
        "fully async + partial": lambda s: simulate_fully_async(
            workload(s), eng, alone, workers=1, slots=slots, capacity=10**9,
            staleness=float(args["staleness"]), sync_every=int(args["sync_every"]),
            partial=True)["samples_per_s"],
    }
    print(f"engine (measured here): d0 {eng.d0 * 1e3:.2f} ms, d1 {eng.d1 * 1e6:.1f} us/seq, "
          f"d2 {eng.d2 * 1e9:.1f} ns/(seq x token), prefill {eng.p * 1e6:.1f} us/token")
    print(f"learner: synchronous runs {train.t0:.2f} s + {train.t1 * 1e6:.0f} us/token, "
          f"one-step-off runs {alone.t0:.2f} s + {alone.t1 * 1e6:.0f} us/token")
    print("| mode | measured samples/s | simulated | simulated / measured |")
    print("|---|---:|---:|---:|")
    for mode, runs in modes.items():
        got = statistics.median(r["samples_per_s"] for r in runs)
        sim = statistics.median(sims[mode](seed) for seed in range(5))
        print(f"| {mode} | {got:.2f} | {sim:.2f} | {sim / got:.2f} |")


# --------------------------------------------------------------------------- planning
PLAN = """The larger case (assumptions):
- policy: a 7B dense model (Qwen2.5-7B shape: 28 layers, 4 KV heads x 128, bf16 weights
  15.2 GB), GRPO with a KL loss, on {gpus} H100s (989 TFLOP/s bf16 dense, 3.35 TB/s HBM);
- a rollout engine per GPU (TP 1), {slots} sequences at once, a paged KV cache (attention
  reads each sequence's own context); a decode step reads the weights and the KV cache once
  at 70% of HBM bandwidth, plus 4 ms of host time; prefill at 40% of peak FLOPs;
- a learner step of FSDP data parallelism over the trainer GPUs: 8 x params FLOPs per token
  (update 6, reference 2) at 35% MFU, plus 2 s; a sync {sync} s (15 GB over NVLink/IB);
- {prompts} prompts x {n} samples a step, 512-token prompts, responses log-normal with a
  median of {median} tokens and the longest of a step ~8x it (sigma 0.67), at most {cap};
- fully async with partial rollout, trigger_parameter_sync_step {T}; {steps} steps, the
  first {warmup} dropped; the simulated clock, not this machine's, so the answer does not
  depend on where it runs."""


def plan(gpus: int = 64, prompts: int = 128, n: int = 8, median: int = 2000, cap: int = 16384,
         steps: int = 12, warmup: int = 3, sync_every: int = 1) -> None:
    params, layers, kv = 7.6e9, 28, 4 * 128
    bw, flops = 3.35e12 * 0.7, 989e12
    kv_bytes_per_token = 2 * layers * kv * 2  # K and V, bf16
    eng = EngineCost(d0=15.2e9 / bw + 4e-3, d1=0.0, d2=kv_bytes_per_token / bw,
                     p=2 * params / (flops * 0.4), longest=False)
    slots, sync_s = 256, 2.0
    print(PLAN.format(gpus=gpus, slots=slots, sync=sync_s, prompts=prompts, n=n,
                      median=median, cap=cap, T=sync_every, steps=steps, warmup=warmup))

    def workload(seed: int) -> Workload:
        return Workload(prompts, n, 512, LengthSampler(cap, median=median, sigma=0.67,
                                                        rng=np.random.default_rng(seed)),
                        steps, warmup)

    def train_on(gpu_count: int) -> TrainCost:
        return TrainCost(2.0, 8 * params / (flops * 0.35 * gpu_count))

    # synchronous, colocated: every GPU generates its share, then every GPU trains
    per_gpu = math.ceil(prompts * n / gpus)
    rng = np.random.default_rng(0)
    sync_clock = 0.0
    for step in range(steps):
        lengths = workload(step).lengths.draw(prompts * n)
        rng.shuffle(lengths)
        gen = max(Engine(eng, slots, 512).generate(lengths[i: i + per_gpu])
                  for i in range(0, len(lengths), per_gpu))
        if step >= warmup:
            sync_clock += gen + train_on(gpus).step(batch_tokens(workload(0), lengths)) + sync_s
    base = (steps - warmup) * prompts * n / sync_clock
    print(f"\nsynchronous, colocated on {gpus} GPUs: {base:.1f} samples/s")
    print("| rollout : trainer GPUs | staleness_threshold | samples/s | vs synchronous | "
          "trainer waits | mean lag (versions) |")
    print("|---|---:|---:|---:|---:|---:|")
    best = None
    for rollout in (gpus // 4, gpus * 3 // 8, gpus // 2, gpus * 5 // 8, gpus * 3 // 4):
        for s in (0.0, 0.5, 1.0):
            r = simulate_fully_async(workload(1), eng, train_on(gpus - rollout),
                                     workers=rollout, slots=slots, capacity=2 * slots,
                                     staleness=s, sync_every=sync_every, partial=True,
                                     sync_s=sync_s)
            print(f"| {rollout} : {gpus - rollout} | {s:g} | {r['samples_per_s']:.1f} | "
                  f"{r['samples_per_s'] / base:.2f}x | {r['trainer_wait']:.0%} | "
                  f"{r['lag_mean']:.2f} |")
            if best is None or r["samples_per_s"] > best[0]:
                best = (r["samples_per_s"], rollout, s)
    print(f"\npredicted best: {best[1]} rollout : {gpus - best[1]} trainer GPUs, "
          f"staleness_threshold {best[2]:g} ({best[0] / base:.2f}x synchronous)")
    drained = simulate_fully_async(workload(1), eng, train_on(gpus - best[1]), workers=best[1],
                                   slots=slots, capacity=2 * slots, staleness=best[2],
                                   sync_every=sync_every, partial=False, sync_s=sync_s)
    print(f"the same without partial rollout (each sync waits for the running requests): "
          f"{drained['samples_per_s']:.1f} samples/s ({drained['samples_per_s'] / base:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, help="async_modes.py --json output to check")
    ap.add_argument("--plan", action="store_true", help="the larger case")
    args = ap.parse_args()
    if args.measured:
        check_two_cores(args.measured)
    if args.plan or not args.measured:
        plan()


if __name__ == "__main__":
    main()
