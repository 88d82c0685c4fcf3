"""Reward scoring throughput: math-verify over 4096 responses, local vs Ray, 1 vs 2 workers.

    .venv/bin/python bench/rewards.py [--n 4096] [--no-ray] [--no-netns] [--no-write]

Responses are realistic `\\boxed{}` endings of math solutions: about half correct, answers in
another form than the gold one (0.75 vs \\frac{3}{4}, (x+1)^2 vs x^2+2x+1, surds, percents,
intervals), so nearly all go through math-verify; a few plain integers take the fast path.
Ray runs inside a loopback-only network namespace (the script re-executes itself under
`unshare --net --map-root-user`) so it never binds the machine's external address.
Appends/replaces the "## Rewards" section of bench/RESULTS.md (other sections are kept).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results import write_section  # noqa: E402
from megarl.rewards import RewardRequest, compute_score, make_reward_pool  # noqa: E402
from megarl.rewards.math_score import fast_equal  # noqa: E402

RESULTS = REPO / "bench" / "RESULTS.md"
DATE = "2026-11-22"


def make_batch(n: int, seed: int = 0) -> tuple[list[RewardRequest], list[float]]:
    """Requests in several answer families (~50% correct) and the score each should get."""
    rng = random.Random(seed)
    out, expected = [], []
    for _ in range(n):
        kind = rng.random()
        ok = rng.random() < 0.5
        if kind < 0.30:  # fraction vs decimal
            q = rng.choice([2, 4, 5, 8, 10, 20, 25])
            p = rng.randint(1, 5 * q)
            gold = f"\\frac{{{p}}}{{{q}}}"
            val = p / q if ok else (p + rng.randint(1, 3)) / q
            pred = f"{val:g}"
        elif kind < 0.50:  # polynomial identity
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            gold = f"x^2+{a + b}x+{a * b}"
            pred = f"(x+{a})(x+{b if ok else b + 1})"
        elif kind < 0.65:  # surds
            k = rng.randint(2, 30)
            gold = f"\\frac{{{k}}}{{\\sqrt{{2}}}}"
            pred = f"\\frac{{{k if ok else k + 1}\\sqrt{{2}}}}{{2}}"
        elif kind < 0.75:  # percent vs fraction of 1
            p = rng.randint(1, 99)
            gold = f"{p / 100:g}"
            pred = f"{p if ok else p + 1}\\%"
        elif kind < 0.85:  # intervals / sets
            lo, hi = sorted(rng.sample(range(-20, 20), 2))
            gold = f"[{lo}, {hi})"
            pred = f"\\left[{lo},{hi if ok else hi + 1}\\right)"
        elif kind < 0.93:  # scaled fractions
            p, q = rng.randint(1, 50), rng.randint(51, 99)
            m = rng.randint(2, 9)
            gold = f"\\frac{{{p}}}{{{q}}}"
            pred = f"\\dfrac{{{p * m if ok else p * m + 1}}}{{{q * m}}}"
        else:  # plain integers (fast path, never math-verify)
            v = rng.randint(-10**6, 10**6)
            gold, pred = str(v), str(v if ok else v + 7)
        body = "Let me work through this step by step.\n\n" + "We simplify the expression. " * rng.randint(3, 30)
        out.append(RewardRequest("math500", f"{body}\n\nTherefore the answer is $\\boxed{{{pred}}}$.", gold))
        expected.append(1.0 if ok else 0.0)
    return out, expected


def _worker_pids(pool) -> list[int]:
    """Pids of the pool's worker processes (bench-only peek at internals; same machine)."""
    if hasattr(pool, "_workers"):
        return [w.pid for w in pool._workers if w is not None]
    import ray

    return [ray.get(s.ready_ref) for s in pool._slots]


def _cpu_seconds(pid: int) -> float:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(pool, reqs):
    """(wall seconds, worker CPU seconds, results) for one pass after a warm-up call."""
    pool.score(reqs[:16])  # warm workers (imports, first math-verify call)
    pids = _worker_pids(pool)
    c0 = sum(_cpu_seconds(p) for p in pids)
    t0 = time.perf_counter()
    res = pool.score(reqs)
    wall = time.perf_counter() - t0
    return wall, sum(_cpu_seconds(p) for p in pids) - c0, res


def _mean(x) -> float:
    return sum(x) / len(x) if isinstance(x, list) else x


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0]
    return f"{cpu}, {os.cpu_count()} cores (shared; load avg {load:.1f} at start), Python {platform.python_version()}"


def write_results(section: str) -> None:
    write_section("Rewards", section)


def reexec_in_netns() -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        print("no unshare/ip: running Ray on the default network", file=sys.stderr)
        return
    cmd = f"ip link set lo up && exec {sys.executable} {Path(__file__).resolve()} " + " ".join(sys.argv[1:])
    for prefix in (["unshare", "--net", "--map-root-user"], ["unshare", "--net"]):
        r = subprocess.run([*prefix, "true"], capture_output=True)
        if r.returncode == 0:
            env = {**os.environ, "MEGARL_BENCH_NETNS": "1"}
            sys.exit(subprocess.call([*prefix, "sh", "-c", cmd], env=env))
    print("network namespaces not permitted: running Ray on the default network", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=2, help="passes over all configs, alternating order")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--no-netns", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not args.no_ray and not args.no_netns and os.environ.get("MEGARL_BENCH_NETNS") != "1":
        reexec_in_netns()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    env_line = machine()
    reqs, expected = make_batch(args.n)
    fast = sum(fast_equal(r.solution_str.rsplit("\\boxed{", 1)[1][:-3], r.ground_truth) is not None for r in reqs)
    print(f"{args.n} responses, {args.n - fast} through math-verify, {fast} fast-path; {env_line}")

    # Reference: the same function in this process, one thread, no pool.
    sub = reqs[:512]
    compute_score("math", "\\boxed{\\frac{1}{2}}", "0.5")  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    ref = [compute_score(r.data_source, r.solution_str, r.ground_truth) for r in sub]
    inproc = len(sub) / (time.perf_counter() - t0)
    cpu_ms = {f"in-process loop (no pool, {len(sub)} items)": 1000 * (time.process_time() - c0) / len(sub)}
    rows = [(next(iter(cpu_ms)), [inproc], [os.getloadavg()[0]], None)]
    print(f"in-process: {inproc:.0f} responses/s")

    configs = [("local", 1), ("local", 2)] + ([] if args.no_ray else [("ray", 1), ("ray", 2)])
    if not args.no_ray:
        import ray

        ray.init(num_cpus=4, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False)
    scores, rates, loads, startups = {}, {c: [] for c in configs}, {c: [] for c in configs}, {}
    for rep in range(args.repeats):  # alternate the order so drifting load hits all configs alike
        for kind, nw in configs if rep % 2 == 0 else configs[::-1]:
            t_start = time.perf_counter()
            with make_reward_pool(kind, num_workers=nw, timeout_s=args.timeout, memory_mb=2048) as pool:
                pool.score(reqs[:1])
                startups.setdefault((kind, nw), time.perf_counter() - t_start)
                secs, cpu, res = timed(pool, reqs)
                stats = dict(pool.stats)
            rates[(kind, nw)].append(args.n / secs)
            cpu_ms.setdefault(f"{kind}, {nw} worker{'s' if nw > 1 else ''}", []).append(1000 * cpu / args.n)
            loads[(kind, nw)].append(os.getloadavg()[0])
            scores[(kind, nw)] = [r.score for r in res]
            bad = stats["reward/timeouts"] + stats["reward/errors"]
            print(f"{kind:5s} x{nw}: {args.n / secs:7.0f} responses/s  ({secs:.1f} s; worker CPU {cpu:.1f} s = "
                  f"{cpu / secs:.2f} cores; load {loads[(kind, nw)][-1]:.1f}; "
                  f"timeouts+errors {bad}; mean score {sum(scores[(kind, nw)]) / args.n:.3f})", flush=True)
    if not args.no_ray:
        ray.shutdown()
    for (kind, nw), r in rates.items():
        rows.append((f"{kind}, {nw} worker{'s' if nw > 1 else ''}", r, loads[(kind, nw)], startups[(kind, nw)]))
    ref_ok = all(scores[k][:512] == ref for k in scores)
    same = all(v == scores[("local", 1)] for v in scores.values())
    as_built = sum(a == b for a, b in zip(scores[("local", 1)], expected)) / args.n
    print(f"all pools agree: {same}; agree with in-process: {ref_ok}; match construction: {as_built:.4f}")

    mean = {name: sum(r) / len(r) for name, r, _, _ in rows}
    lines = [
        "## Rewards",
        "",
        f"`bench/rewards.py`, {DATE}. Machine: {env_line}.",
        f"{args.n} `\\boxed{{}}` responses (math500-style, ~50% correct, {args.n - fast} through math-verify, "
        f"{fast} integer fast-path), timeout_s={args.timeout}, memory_mb=2048. Ray: local cluster "
        "(num_cpus=4, 80 MiB object store) in a loopback-only network namespace, up during all runs. "
        f"{args.repeats} passes over the configs in alternating order; responses/s is their mean.",
        "",
        "| scorer | responses/s (mean) | per pass | vs in-process | vs same kind x1 | worker CPU ms/response "
        "| load avg during | ready after (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r, ld, startup in rows:
        kind = name.split(",")[0]
        one = mean.get(f"{kind}, 1 worker")
        lines.append(
            f"| {name} | {mean[name]:.0f} | {' / '.join(f'{x:.0f}' for x in r)} | {mean[name] / inproc:.2f} | "
            f"{'' if one is None else f'{mean[name] / one:.2f}'} | {_mean(cpu_ms[name]):.1f} | "
            f"{' / '.join(f'{x:.1f}' for x in ld)} | "
            f"{'' if startup is None else f'{startup:.1f}'} |"
        )
    lines += [
        "",
        f"All pools gave identical scores: {same} (and equal to the in-process loop on the first {len(sub)}: {ref_ok}); "
        f"{100 * as_built:.2f}% equal the correctness the batch was built with.",
        "The 2 cores were shared with other jobs (load avg above 2 means every process got under one core), "
        "so responses/s and the x2 ratios measure the CPU share obtained, not the pool; worker CPU ms/response "
        "(user+sys of the worker processes / responses; in-process: this process) is the load-independent cost.",
        "",
    ]
    section = "\n".join(lines)
    print(section)
    if not args.no_write:
        write_results(section)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
