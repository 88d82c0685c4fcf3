"""The hostile custom reward file and the mixed batch shared by the reward-pool tests.

A plain module with a unique name (not conftest): test files and the Ray child process import it
by name, and ``conftest`` is ambiguous once several test folders are collected in one session.
"""

import textwrap

HOSTILE_FN = textwrap.dedent(
    '''
    import ctypes, os, time

    from megarl.rewards import compute_score


    def compute(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        mode = (extra_info or {}).get("mode", "normal")
        if mode == "sleep":
            time.sleep(10**6)
        if mode == "alloc":
            block = bytearray(10 * 2**30)
            return float(len(block))
        if mode == "exit":
            os._exit(7)
        if mode == "segv":
            ctypes.string_at(0)
        if mode == "raise":
            raise ValueError("custom function failed")
        if mode == "dict":
            return {"score": 0.5 + bonus, "acc": 1, "note": "hi"}
        return compute_score(data_source, solution_str, ground_truth, extra_info) + bonus


    def helper_not_the_scorer():
        return None
    '''
)

# The mixed batch of the pool tests: (mode, response, ground truth, expected score, status).
MIXED = [
    ("normal", "so \\boxed{12}", "12", 1.0, "ok"),
    ("sleep", "\\boxed{1}", "1", 0.0, "timeout"),
    ("normal", "\\boxed{7}", "8", 0.0, "ok"),
    ("alloc", "\\boxed{1}", "1", 0.0, "error"),
    ("normal", "\\boxed{\\frac{1}{2}}", "0.5", 1.0, "ok"),
    ("exit", "\\boxed{1}", "1", 0.0, "error"),
    ("segv", "\\boxed{1}", "1", 0.0, "error"),
    ("raise", "\\boxed{1}", "1", 0.0, "error"),
    ("dict", "\\boxed{1}", "1", 0.5, "ok"),
    ("normal", "\\boxed{50\\%}", "0.5", 1.0, "ok"),
    ("normal", "\\boxed{-3}", "-3", 1.0, "ok"),
]
