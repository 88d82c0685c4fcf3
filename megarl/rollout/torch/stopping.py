"""Incremental stop-string detection over generated token ids.

After each new token, a sequence is checked only when that token could complete a stop string:
its own decoded text holds the last character of some stop string, or it decodes to nothing or
to an incomplete byte sequence (U+FFFD), where the character may come from combining with the
tokens before it. Such tokens are rare, and the answer per token id is cached. The check decodes
only the last ``window`` generated tokens (4 tokens per character of the longest stop string,
enough for byte-level tokens of 4-byte UTF-8), never the whole response, and looks for any stop
string in that text. A string that straddles the prompt and the response does not count (as
vLLM); the token that completes the string is kept in the output.
"""

from __future__ import annotations

from typing import Any


class StopStrings:
    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        stops = [s for s in stops if s]
        if stops and tokenizer is None:
            raise ValueError(
                "SamplingParams.stop needs a tokenizer: build the engine with tokenizer=... "
                "(from_pretrained loads the one next to the model) or use stop_token_ids"
            )
        self.tokenizer = tokenizer
        self.stops = stops
        self.last_chars = {s[-1] for s in stops}
        self.window = 4 * max((len(s) for s in stops), default=0) + 4
        self._maybe: dict[int, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.stops)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _may_complete(self, token: int) -> bool:
        hit = self._maybe.get(token)
        if hit is None:
            text = self._decode([token])
            hit = not text or "\ufffd" in text or any(c in text for c in self.last_chars)
            self._maybe[token] = hit
        return hit

    def hit(self, generated: list[int]) -> bool:
        """True when the generated ids (last one just appended) now contain a stop string."""
        if not self.stops or not self._may_complete(generated[-1]):
            return False
        text = self._decode(generated[-self.window :])
        return any(s in text for s in self.stops)
