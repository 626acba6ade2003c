"""The OpenAI request bodies we accept (pydantic), and their translation to SamplingParams.

Unknown fields are ignored (clients send many); known fields we cannot honour with a
non-default value (best_of > 1, echo, suffix, tools) are rejected with a 400 naming the
parameter, never silently dropped.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.sampling import MAX_LOGPROBS, InvalidRequestError, SamplingParams

MAX_N = 16           # choices per prompt (each is one request to the scheduler)
MAX_CHOICES = 64     # prompts x n of one /v1/completions call


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None          # tokens to generate; None = fill up to the default cap
    temperature: float | None = None       # None = 1.0 (OpenAI's default)
    top_p: float | None = None             # None = 1.0
    top_k: int | None = None               # extension (vLLM's): None or -1 disables
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str | int] | None = None   # strings; ints are taken as stop token ids
    stop_token_ids: list[int] | None = None     # extension (vLLM's)
    seed: int | None = None
    ignore_eos: bool = False               # extension: generate past EOS (benchmarks)
    presence_penalty: float | None = None  # None = 0
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM's): None = 1.0 (off)
    min_tokens: int | None = None            # extension (vLLM's): None = 0
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if isinstance(s, str) and s]

    def all_stop_token_ids(self) -> list[int]:
        stops = [] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if isinstance(s, int)] + list(self.stop_token_ids or [])

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        """Reject what we would otherwise silently ignore."""
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if isinstance(self.stop, list) and len(self.stop_strings()) > 16:
            raise InvalidRequestError("at most 16 stop strings are supported", "stop")

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or the number of top alternatives per token."""
        return None

    def sampling(self, max_tokens: int) -> SamplingParams:
        """Validated sampling parameters (raises InvalidRequestError naming the field)."""
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=-1 if self.top_k is None else self.top_k,
                              max_tokens=max_tokens, seed=self.seed,
                              stop_token_ids=self.all_stop_token_ids(), ignore_eos=self.ignore_eos,
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              min_tokens=self.min_tokens or 0, logprobs=self.num_logprobs())


class CompletionRequest(_GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for param, unsupported in (("echo", self.echo), ("suffix", bool(self.suffix)),
                                   ("best_of", (self.best_of or 1) > 1)):
            if unsupported:
                raise InvalidRequestError(f"{param} is not supported", param)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, in order (choice i * n + j is choice j of prompt i):
        a text, a list of texts, a list of token ids, or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts or any(not q for q in prompts):
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if len(prompts) * self.n > MAX_CHOICES:
            raise InvalidRequestError(f"at most {MAX_CHOICES} choices (prompts x n) per request", "prompt")
        return prompts


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise InvalidRequestError("only text content parts are supported", "messages")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                                          "top_logprobs")
        if self.tools:
            raise InvalidRequestError("tools are not supported", "tools")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is the newer name of "system"; chat templates only know the latter.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]
