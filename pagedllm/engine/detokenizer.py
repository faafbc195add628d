"""Incremental detokenization and stop strings, one request at a time.

Text is produced by the tokenizers library's DecodeStream, primed with the end of the
prompt so the first word gets its leading space right, and O(1) per token. With stop
strings, the last (longest stop - 1) characters are held back from streamed text until
it is clear they do not start a stop string, so a client never sees half of one.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from pagedllm.sampling_params import SamplingParams

_PROMPT_PRIMING_TOKENS = (4, 24)  # look back this many prompt tokens for a clean text boundary


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._params = params
        self._stop_strings = params.stop_strings
        self._hold_back = max((len(s) for s in self._stop_strings), default=1) - 1
        self._num_tokens = 0
        self.num_taken = 0
        """Of the tokens the last append() was given, how many it took (up to a stop string)."""
        self.output_text = ""
        prefix = _clean_prompt_suffix(tokenizer, prompt_token_ids)
        self._stream = DecodeStream(ids=prefix, skip_special_tokens=params.skip_special_tokens)

    def append(self, token_ids: list[int]) -> str | None:
        """Add new tokens' text. Returns the stop string they completed, if any; the output
        text is then cut at it (kept when include_stop_str_in_output), and the tokens after the
        one that completed it are not taken (num_taken: several come at once from speculative
        decoding, and plain decoding would have stopped there)."""
        self.num_taken = 0
        for token_id in token_ids:
            start = len(self.output_text)
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self.output_text += piece
            self._num_tokens += 1
            self.num_taken += 1
            if self._stop_strings and self._num_tokens >= self._params.min_tokens:
                stop = self._find_stop(max(0, start - self._hold_back))
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            index = self.output_text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self._params.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: all of it once finished, else minus the hold-back."""
        if finished or not self._hold_back:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self._hold_back)]


def _clean_prompt_suffix(tokenizer, prompt_token_ids: list[int]) -> list[int]:
    """The shortest prompt tail (4..24 tokens) that decodes without a broken character."""
    low, high = _PROMPT_PRIMING_TOKENS
    if len(prompt_token_ids) <= low:
        return list(prompt_token_ids)
    for n in range(low, min(len(prompt_token_ids), high) + 1):
        suffix = prompt_token_ids[-n:]
        if "\ufffd" not in tokenizer.decode(suffix):
            return suffix
    return prompt_token_ids[-low:]
