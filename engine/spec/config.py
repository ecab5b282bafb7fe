"""The engine's speculative-decoding settings (the `speculative:` config section, checked there too)."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("off", "ngram", "draft")


@dataclass(slots=True)
class SpecConfig:
    """Args:
        method: `off`; `ngram`: propose the continuation of the latest earlier occurrence of the
            sequence's last n tokens (n from `ngram_max` down to `ngram_min`) in its prompt + output;
            `draft`: a small model with the same tokenizer (`draft_model`) drafts them.
        num_tokens: k, the most tokens proposed per sequence and step.
        draft_model: the draft's directory or preset name (method `draft`).
        draft_num_tokens: k for the draft method (None: `num_tokens`).
        ngram_min, ngram_max: the n-gram lengths tried, longest first.
        adaptive: pick k per step (0 included) from the decode throughput measured with each k at
            this batch size (engine/spec/turn_down.py); False: always num_tokens.
    """

    method: str = "off"
    num_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    adaptive: bool = True
    draft_model: str | None = None
    draft_num_tokens: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the setting when the combination cannot run."""
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.num_tokens <= 0:
            raise ValueError(f"speculative.num_tokens must be >= 1, got {self.num_tokens}")
        if self.ngram_min <= 0:
            raise ValueError(f"speculative.ngram.min must be >= 1, got {self.ngram_min}")
        if self.draft_num_tokens is not None and self.draft_num_tokens <= 0:
            raise ValueError(f"speculative.draft.num_tokens must be >= 1, got {self.draft_num_tokens}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.draft.model: required with speculative.method draft")
        if self.ngram_max < self.ngram_min:
            raise ValueError(f"speculative.ngram.max ({self.ngram_max}) must be >= speculative.ngram.min "
                             f"({self.ngram_min})")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def k(self) -> int:
        """The most tokens proposed per sequence and step under this method."""
        return self.draft_num_tokens or self.num_tokens if self.method == "draft" else self.num_tokens
