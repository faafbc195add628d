"""--speculative-config: vLLM's JSON for speculation without a draft model.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 5}'

Only the keys of the methods built here are accepted; any other key (a draft `model`, a typo) is
an error that names it, so a setting never silently does nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    """Most draft tokens proposed for one request in one step."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix of the context matched against it."""
    prompt_lookup_max: int = 5
    """ngram: the longest."""
    disable_by_batch_size: int | None = None
    """No drafts in a step once this many requests are running (vLLM's key); None: decided by
    measured acceptance only."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the longest context suffix (and proposal) the trees index."""
    suffix_decoding_max_cached_requests: int = 1000
    """suffix: finished requests whose outputs the shared tree keeps (0: none, per-request only)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: a proposal is at most this times the matched suffix's length."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: a proposal stops at a token seen after the match less often than this."""

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, message: str) -> None:
            if not ok:
                raise ValueError(f"speculative_config.{key}: {message}")

        need(self.method in METHODS, "method", f"must be one of {', '.join(METHODS)}, not {self.method!r}")
        for key in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "suffix_decoding_max_tree_depth",
            "suffix_decoding_max_cached_requests",
        ):
            value = getattr(self, key)
            need(
                type(value) is int and 0 <= value <= 1024,
                key,
                f"must be an integer in [0, 1024], not {value!r}",
            )
        need(self.num_speculative_tokens >= 1, "num_speculative_tokens", "must be at least 1")
        need(self.prompt_lookup_min >= 1, "prompt_lookup_min", "must be at least 1")
        need(
            self.prompt_lookup_max >= self.prompt_lookup_min,
            "prompt_lookup_max",
            f"must be at least prompt_lookup_min ({self.prompt_lookup_min})",
        )
        need(
            self.disable_by_batch_size is None
            or (type(self.disable_by_batch_size) is int and self.disable_by_batch_size >= 1),
            "disable_by_batch_size",
            "must be a positive integer or null",
        )
        for key in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            value = getattr(self, key)
            need(
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1024,
                key,
                f"must be a number in [0, 1024], not {value!r}",
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict (LLM(speculative_config=...)) or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config: not valid JSON ({error})") from None
            except RecursionError:  # json's parser recurses once per level
                raise ValueError("speculative_config: nested too deep; it is one flat JSON object") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; pagedllm reads "
                f"{', '.join(sorted(known))} (no draft model: methods ngram and suffix)"
            )
        nested = sorted(key for key, item in value.items() if isinstance(item, dict | list))
        if nested:
            raise ValueError(
                f"speculative_config.{nested[0]}: must be a number, string or null, not a nested value"
            )
        if "method" not in value:
            raise ValueError(f"speculative_config.method: required, one of {', '.join(METHODS)}")
        return cls(**value)
