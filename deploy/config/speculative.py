"""The ``speculative`` section: speculative decoding on decode and colocated actors (engine/spec)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from deploy.config.base import FieldProblem, Int, Section
from deploy.config.model import check_model_name
from engine.spec.config import SpecConfig


def _off(value: object) -> object:
    """A bare `off` reads as false in YAML 1.1 (and in --set values): it means the method off."""
    return "off" if value is False else value


class NgramSection(Section):
    """Prompt lookup: the last n tokens are looked up in the sequence's prompt + output, longest n first."""

    min: Int = Field(1, ge=1, description="Shortest n-gram looked up.")
    max: Int = Field(3, ge=1, description="Longest n-gram looked up (tried first).")

    @model_validator(mode="after")
    def _ordered(self) -> "NgramSection":
        if self.max < self.min:
            raise FieldProblem("max", f"must be >= {{here}}.min ({self.max} < {self.min})")
        return self


class DraftSection(Section):
    """The draft method's model."""

    model: Optional[Annotated[str, AfterValidator(check_model_name)]] = Field(
        None, description="The draft: a model directory or an embedded name (pydoc-draft drafts for pydoc); "
        "it must have the served model's tokenizer. Relative paths are relative to the config file.")
    num_tokens: Optional[Int] = Field(None, ge=1, description="k for the draft method (null: speculative.num_tokens).")


class SpeculativeSection(Section):
    """Speculative decoding on decode and colocated actors: each decoding sequence proposes up to
    ``num_tokens`` tokens that the next step verifies with the served model. Greedy output is
    unchanged; sampling keeps the model's distribution (the rejection rule). Prefill actors are
    unaffected."""

    method: Annotated[Literal["off", "ngram", "draft"], BeforeValidator(_off)] = Field(
        "off", description="off; ngram: propose the continuation of the latest earlier occurrence of the "
        "sequence's last tokens in its prompt + output (no extra model; wins where outputs repeat their context); "
        "draft: a small model with the same tokenizer (speculative.draft.model) drafts them.")
    num_tokens: Int = Field(4, ge=1, description="k: the most tokens proposed per sequence and step.")
    ngram: NgramSection = Field(default_factory=NgramSection, description="The ngram method's lookup.")
    draft: DraftSection = Field(default_factory=DraftSection, description="The draft method's model.")
    adaptive: bool = Field(True, description="Pick k per step (0: no proposals) from the decode throughput "
                           "measured with each k at the batch's size; false: always num_tokens.")

    @model_validator(mode="after")
    def _draft_named(self) -> "SpeculativeSection":
        if self.method == "draft" and not self.draft.model:
            raise FieldProblem("draft.model", "required with speculative.method draft")
        return self

    def engine_config(self) -> SpecConfig:
        """The engine's settings (engine/spec/config.py)."""
        return SpecConfig(self.method, self.num_tokens, self.ngram.min, self.ngram.max, self.adaptive,
                          self.draft.model, self.draft.num_tokens)
