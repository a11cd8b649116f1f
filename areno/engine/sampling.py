"""Per-request sampling parameters, validated once at the engine boundary.

`SamplingParams` is what the scheduler and the sampler read; it is immutable so that the n
sequences of a request (and the rows built from them) can share one instance safely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from areno.errors import ConfigError

MAX_TOP_LOGPROBS = 20
LOGPROBS_MODES = ("raw", "tempered")
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100] (OpenAI's range)
STRUCTURED_KINDS = ("json_schema", "json_object", "structural_tag")
# The range torch.Generator.manual_seed accepts; the protocol enforces the same bounds.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `n=True` is a caller bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _fail(param: str, message: str) -> ConfigError:
    return ConfigError(f"SamplingParams.{param} {message}", param=param)


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar every token of the output must follow (areno/engine/outputs/grammar.py).

    kind: "json_schema" (spec: a JSON Schema as JSON text), "json_object" (any JSON object;
        spec ""), or "structural_tag" (spec: an xgrammar structural tag as JSON text, how tool
        calls are constrained in each family's call syntax).
    param: the request field a grammar that does not compile is blamed on (the error's
        `param`), e.g. "response_format" or "tools".
    """

    kind: str
    spec: str = ""
    param: str = "structured"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise _fail("structured", f"kind must be one of {STRUCTURED_KINDS}; got {self.kind!r}")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise _fail("structured", f"a {self.kind} needs its spec as JSON text")


@dataclass(frozen=True)
class SamplingParams:
    """How to draw the tokens of one request.

    temperature: 0 is greedy (argmax); otherwise logits are divided by it before filtering.
    top_p: nucleus mass in (0, 1]; 1 keeps every token.
    top_k: -1 (or 0) keeps every token, else the k most likely; 0 is normalised to -1.
    min_p: drop tokens whose probability is below min_p x the most likely token's; 0 is off.
    seed: a per-request seed; sample i of the request uses `seed + i` (see `Sequence.seed`).
    max_tokens: generation limit (None: only the context length limits it).
    stop / stop_token_ids: strings and token ids that end generation with reason "stop".
    ignore_eos: keep generating past the model's EOS tokens (benchmarks, RL with fixed lengths).
    n: number of samples drawn from one shared prompt.
    logprobs / top_logprobs: return the chosen token's logprob / the K most likely (0..20).
    logprobs_mode: "raw" reports the log-softmax of the model's logits, as OpenAI-style clients
        expect; "tempered" that of the logits divided by the temperature (before top-k / top-p /
        min-p), the distribution an RL trainer recomputes for the tokens a rollout sampled.
    include_stop_str_in_output: keep a matched stop string at the end of the output text.
    detokenize: produce text; off for token-only work (benchmarks, scoring), not with `stop`.
    skip_special_tokens: leave special tokens out of the text; off when a tool-call parser must
        see tags that are special tokens. A stop token's own text is never part of the output.
    adapter: the LoRA adapter the request runs with, by the name it was loaded under
        (areno/engine/layers/lora.py); None: the engine's default (the base model, or the policy
        adapter an RL weight sync loaded).
    presence_penalty / frequency_penalty: subtracted from a token's logit once if it occurs in
        the output so far / once per occurrence (OpenAI's definition; [-2, 2], 0 is off).
    repetition_penalty: a token of the prompt or the output so far has a positive logit divided
        by it and a negative one multiplied by it (> 0; 1 is off).
    logit_bias: (token id, bias in [-100, 100]) pairs added to the logits; a dict is accepted.
    min_tokens: EOS, stop_token_ids and stop strings cannot end the output before this many
        tokens.
    structured: a grammar the output follows (StructuredOutput), None: free text.
    Penalties, biases and grammars change which token is drawn; the reported logprobs stay
    those of the model (see logprobs_mode).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = "raw"
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    adapter: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; tuples keep the instance hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted(tuple(pair) for pair in bias)))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        self._check_filters()
        self._check_penalties()
        self._check_limits()
        self._check_outputs()

    def _check_filters(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise _fail(
                "temperature",
                f"must be a finite number >= 0 (0 = greedy); got {self.temperature!r}",
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _fail("top_p", f"must be in (0, 1] (1 = off); got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise _fail("top_k", f"must be -1 or 0 (off) or an integer >= 1; got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _fail("min_p", f"must be in [0, 1] (0 = off); got {self.min_p!r}")
        if self.seed is not None and (
            not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            raise _fail("seed", f"must be None or an integer in [-2**63, 2**64); got {self.seed!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise _fail(name, f"must be in [-2, 2] (0 = off); got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _fail(
                "repetition_penalty",
                f"must be a number > 0 (1 = off); got {self.repetition_penalty!r}",
            )
        for pair in self.logit_bias:
            if (
                len(pair) != 2
                or not _is_int(pair[0])
                or pair[0] < 0
                or not _is_number(pair[1])
                or not -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS
            ):
                raise _fail(
                    "logit_bias",
                    f"maps token ids >= 0 to biases in [-100, 100]; got {pair!r}",
                )
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise _fail("logit_bias", "names a token id twice")

    @property
    def has_penalties(self) -> bool:
        """Whether tokens already seen change the logits (the sampler then keeps counts)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def _check_limits(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _fail("max_tokens", f"must be None or an integer >= 1; got {self.max_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise _fail("n", f"must be an integer >= 1; got {self.n!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise _fail("stop", f"must hold non-empty strings; got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise _fail("stop", "needs detokenize=True: stop strings are matched on the text")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _fail("stop_token_ids", f"must hold integers >= 0; got {self.stop_token_ids!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _fail("min_tokens", f"must be an integer >= 0; got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail(
                "min_tokens",
                f"= {self.min_tokens} is above max_tokens = {self.max_tokens}",
            )
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise _fail("structured", f"must be a StructuredOutput; got {self.structured!r}")
        if self.structured is not None and self.min_tokens:
            # NOTE: a grammar ends the reply where its document ends (a closed JSON value, a
            # forced call): a floor on the length could not be kept there, only broken.
            raise ConfigError(
                f"min_tokens = {self.min_tokens} cannot be combined with a grammar "
                f"({self.structured.param}): the grammar decides where the reply ends. Drop "
                "min_tokens, or the structured output",
                param="min_tokens",
            )

    def _check_outputs(self) -> None:
        k = self.top_logprobs
        if not _is_int(k) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise _fail("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]; got {k!r}")
        if k and not self.logprobs:
            raise _fail("top_logprobs", f"= {k} requires logprobs=True")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise _fail("adapter", f"must be None or an adapter's name; got {self.adapter!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise _fail(
                "logprobs_mode", f"must be one of {LOGPROBS_MODES}; got {self.logprobs_mode!r}"
            )

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0
