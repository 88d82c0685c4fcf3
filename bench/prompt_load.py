"""Loading the prompt file at start: no cache vs the token cache vs the whole-file cache.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prompt_load.py [--repeats 5] [--no-write]

Every rank of every run builds its ``RLDataset`` from the prompt files; this times that load
of the demo's 20,000 training prompts three ways in this process, alternating them each round
(the box's noise lands on all three alike): with ``MEGARL_CACHE_DIR=off``; with only the token
ids cached (megarl.data.token_cache, the file level off); with the whole load cached
(megarl.data.prompt_cache). Both caches are warmed first. Prints each way's median seconds and
its ratio to the uncached load, and checks that the three datasets are equal. Appends/replaces
the "## Prompt file load" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results import write_section  # noqa: E402
from megarl.data import (  # noqa: E402
    RLDataset,
    load_tokenizer,
    prompt_cache,  # noqa: E402
)

FILE = "embedded://arith/train.parquet"


def load(tok, cache: str, file_level: bool) -> tuple[float, RLDataset]:
    os.environ["MEGARL_CACHE_DIR"] = cache
    prompt_cache.MIN_ROWS = prompt_cache.token_cache.MIN_ROWS if file_level else 10**12
    t = time.perf_counter()
    ds = RLDataset(FILE, tok, max_prompt_length=64)
    return time.perf_counter() - t, ds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    tok = load_tokenizer("embedded://policy")
    with tempfile.TemporaryDirectory() as tokens_only, tempfile.TemporaryDirectory() as whole:
        ways = {"no cache": ("off", False), "token ids cached": (tokens_only, False),
                "whole load cached": (whole, True)}
        for cache, file_level in ways.values():  # warm both caches
            load(tok, cache, file_level)
        times: dict[str, list[float]] = {w: [] for w in ways}
        loaded = {}
        for _ in range(args.repeats):
            for way, (cache, file_level) in ways.items():
                seconds, loaded[way] = load(tok, cache, file_level)
                times[way].append(seconds)
    first = loaded["no cache"]
    assert all(ds.items == first.items for ds in loaded.values()), "the loads differ"
    base = statistics.median(times["no cache"])
    lines = [f"The demo's {len(first):,} training prompts, one `RLDataset` load, median of "
             f"{args.repeats} (`bench/prompt_load.py`, {platform.processor() or 'x86_64'}, "
             f"one thread):", "", "| load | seconds | vs no cache |", "|---|---:|---:|"]
    for way, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {way} | {med:.3f} | {med / base:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section("Prompt file load", text)


if __name__ == "__main__":
    main()
