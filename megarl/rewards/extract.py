"""Answer extraction from untrusted model text (linear-time scans, no regex backtracking)."""

from __future__ import annotations

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _balanced_group(text: str, open_idx: int) -> str | None:
    """Content of the brace group opening at `text[open_idx] == "{"`, or None if it never closes.

    Escaped braces (`\\{`, `\\}`) are literal characters, not structure.
    """
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_idx + 1 : i]
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` in `text` (balanced braces), else None.

    The last command start wins, so `\\boxed{\\boxed{3}}` gives "3". `\\boxed 7` (space form)
    gives the token after the space. A last box that never closes (truncated output) gives None.
    """
    start = -1
    cmd = ""
    for c in _BOX_COMMANDS:
        i = text.rfind(c)
        while i >= 0 and text[i + len(c) : i + len(c) + 1].isalpha():  # e.g. \boxedtext
            i = text.rfind(c, 0, i)
        if i > start:
            start, cmd = i, c
    if start < 0:
        return None
    j = start + len(cmd)
    if j < len(text) and text[j] == " ":
        rest = text[j + 1 :].lstrip(" ")
        token = rest.split("$", 1)[0].split(None, 1)
        return token[0] if token else None
    while j < len(text) and text[j] in " \t":
        j += 1
    if j >= len(text) or text[j] != "{":
        return None
    return _balanced_group(text, j)


def last_tag_content(text: str, tag: str) -> str | None:
    """Content of the last `<tag>...</tag>` pair in `text`, else None."""
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    end = text.rfind(close_t)
    while end >= 0:
        start = text.rfind(open_t, 0, end)
        if start >= 0:
            return text[start + len(open_t) : end]
        end = text.rfind(close_t, 0, end)
    return None


def last_nonempty_line(text: str) -> str | None:
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return None
