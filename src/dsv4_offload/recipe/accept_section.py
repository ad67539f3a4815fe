"""The recipe's acceptance section: what `accept` sends and what it requires of the answers,
the server log and the decode speed."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from dsv4_offload.recipe.fields import Name, Strict, no_duplicates


class Probe(Strict):
    name: Name = Field(description="unique plain name")
    prompt: str = Field(min_length=1, description="the prompt sent")
    expect_any: list[str] = Field(min_length=1, description="the answer must contain one")
    max_new_tokens: int = Field(64, gt=0, description="tokens to generate")
    chat: bool = Field(False, description="send as a chat message instead of a raw completion")


class Degeneration(Strict):
    """The guide's "garbled, all repeated characters or NaN" (§8, G345) as thresholds."""

    max_char_run: int = Field(
        12, gt=1,
        description="longest run of one repeated character allowed in an answer")
    max_token_run: int = Field(6, gt=1, description="one token repeated more times fails")
    max_loop_repeats: float = Field(
        4, gt=1, description="a loop of 2 to min_sentence_period-1 tokens repeated more fails")
    min_sentence_period: int = Field(
        8, gt=2, description="a cycle this long or longer is a repeated sentence: it passes "
        "with a note (greedy decoding does this)")
    max_scripts: int = Field(3, gt=0, description="more writing systems mixed is token soup "
                             "(a Chinese answer may quote a Latin and a Cyrillic name)")
    min_script_share: float = Field(
        0.05, gt=0, lt=1, description="a writing system counts only above this share of letters")
    max_symbol_share: float = Field(
        0.3, gt=0, lt=1, description="more symbols than this share of the text is garbage")


class LogMarker(Strict):
    """A server log line to look for; a plain string in the recipe is its pattern."""

    pattern: str = Field(min_length=1, description="a Python regular expression")
    name: str = Field("", description="a short name shown in the report")
    when_env: dict[str, str] = Field(
        {}, description="checked only when the server's environment has these values")
    fix: str = Field("", description="what to do when the check fails")
    after_prompt_tokens: int = Field(
        0, ge=0, description="checked only when accept sent a prompt at least this long "
        "(lines only a long prefill prints)")
    source: str = Field("", description="where the text is printed: repository, file, line, "
                        "commit (the pin, a patch, or upstream: say which)")
    confirmed: bool = Field(
        True, description="false: the text is not confirmed in the pinned source (only the "
        "guide, the fork's other branch or upstream print it); a missing line is a warning")
    when_patch: Name | None = Field(
        None, description="checked only when the series applies this patch (a line that only "
        "a patch of our own prints)")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"pattern": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _compiles(self) -> LogMarker:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"pattern {self.pattern!r} is not a regular expression ({exc})"
                             ) from None
        return self

    @property
    def label(self) -> str:
        return repr(self.name or self.pattern)


class Throughput(Strict):
    """decode_throughput_test.sh's method: buckets, warm-up per bucket, new tokens, repeats."""

    prompt_buckets: list[int] = Field(
        [130, 1000, 8000, 16000, 32000], min_length=1,
        description="prompt lengths in tokens to measure decode speed at")
    new_tokens: int = Field(1000, gt=0, description="tokens generated per measurement")
    repeats: int = Field(3, gt=0, description="measurements per bucket (the median counts)")
    warmup: int = Field(1, ge=0, description="full generations discarded before each bucket")
    quick_new_tokens: int = Field(64, gt=0, description="accept --quick: tokens per request")
    reference_tok_s: float = Field(
        gt=0, description="the delivery's decode speed, tokens/s: the headline, and the "
        "reference of a bucket reference_by_bucket does not name")
    reference_range: tuple[float, float] = Field(
        description="[low, high] tokens/s the delivery publishes (shown with the verdict)")
    reference_by_bucket: dict[int, float] = Field(
        {}, description="the delivery's median per bucket (its own table), tokens/s")
    reference_source: str = Field(
        "", description="where the reference comes from (file and commit): shown in the report")
    pass_ratio: float = Field(
        0.93, gt=0, le=1, description="a bucket's median below this x its reference fails "
        "(from the spread of the delivery's own table; see the recipe)")
    warn_ratio: float = Field(
        1.0, gt=0, le=1.5, description="a median below this x its reference passes with a "
        "warning")
    report_only: bool = Field(
        False, description="measure and show, never fail: for a reference not measured on "
        "the pinned stack")
    server_chunk: int = Field(
        32768, gt=0, description="the chunked prefill `run` starts the server with, so the "
        "longest bucket fits one chunk (guide §7 L302-307, §8.1: CHUNKED_PREFILL_SIZE=32768)")

    @model_validator(mode="after")
    def _ratios(self) -> Throughput:
        if self.pass_ratio > self.warn_ratio:
            raise ValueError(f"pass_ratio {self.pass_ratio:g} is above warn_ratio "
                             f"{self.warn_ratio:g}; the failing line must be the lower one")
        return self


class Residency(Strict):
    """Greedy probes before and after a prompt that streams its prefill (acceptance/
    residency.py says why and how they are compared)."""

    min_similarity: float = Field(
        0.75, gt=0, le=1,
        description="the lowest mean difflib ratio between each probe's answers before and "
        "after the streamed prompt (1.0: identical); a second team measured 0.36 with "
        "sglang/0003's broken resident write and 0.91 with it fixed")


class Acceptance(Strict):
    api: Literal["native", "openai"] = Field(
        "native",
        description="`native` sglang `/generate` or `openai` `/v1/completions`")
    request_timeout_s: float = Field(300, gt=0, description="seconds per request")
    probes: list[Probe] = Field(
        min_length=1,
        description="prompts whose answers must contain an expected string")
    determinism_probe: Name = Field(
        description="the probe sent twice at temperature 0; both answers must match")
    degeneration: Degeneration = Field(
        Degeneration(),
        description="thresholds that flag repetitive output")
    log_markers_required: list[LogMarker] = Field(
        [],
        description="lines the server log must show, read after all of accept's traffic: a "
        "regular expression, or {name, pattern, when_env, fix}")
    log_markers_forbidden: list[LogMarker] = Field(
        [],
        description="lines the server log must never show (same forms as the required ones)")
    throughput: Throughput = Field(description="decode-speed measurement and its reference")
    residency: Residency = Field(
        Residency(), description="answers compared across a prompt that streams (dynamic "
        "residency moves the resident experts there)")
    gpqa_reference_pct: float | None = Field(
        None,
        description="the delivery's GPQA score, for comparison")

    @model_validator(mode="after")
    def _refs(self) -> Acceptance:
        no_duplicates([p.name for p in self.probes], "probes", "name")
        if self.determinism_probe not in {p.name for p in self.probes}:
            raise ValueError(f"determinism_probe '{self.determinism_probe}' is not a probe name")
        return self
