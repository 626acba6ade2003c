"""The OpenAI request bodies we accept (pydantic), and their translation to SamplingParams.

Unknown fields are ignored (clients send many); known fields that would change the output and
that we cannot honour (best_of > 1, echo, suffix, functions / function_call, audio output,
prediction) are rejected with a 400 naming the parameter, never silently dropped. Fields that
only label a request (user, metadata, store, service_tier) are accepted and ignored.

Every list, text and object field has a size bound (shared.limits), stated in the OpenAPI schema
and checked while the body is parsed, so an oversized field is a 400 naming it before any
tokenization, template rendering or grammar compile. A JSON schema given as an object is
bounded by the length of its compact JSON text (its description in the schema says so).

Output constraints (structured outputs), at most one per request: `response_format`
(json_object, json_schema), or as vLLM's extensions `structured_outputs` {json | regex | choice |
grammar | json_object} or the older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`; chat's tools with tool_choice "required" or a named function are one too
(gateway.tools).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from shared import limits as L
from shared.sampling import MAX_LOGPROBS, InvalidRequestError, SamplingParams

_NAME = r"^[a-zA-Z0-9_-]{1,64}$"     # OpenAI's rule for schema and function names

MAX_N = 16           # choices per prompt (each is one request to the scheduler)
MAX_CHOICES = L.MAX_PROMPTS     # prompts x n of one /v1/completions call
_INT32 = 2**31 - 1   # token ids (a vocabulary is far smaller; the vocabulary check follows)

Name = Annotated[str, Field(max_length=L.MAX_NAME_CHARS)]
Text = Annotated[str, Field(max_length=L.MAX_TEXT_CHARS)]
Description = Annotated[str, Field(max_length=L.MAX_DESCRIPTION_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=_INT32)]
StopString = Annotated[str, Field(max_length=L.MAX_STOP_CHARS)]
Regex = Annotated[str, Field(min_length=1, max_length=L.MAX_REGEX_CHARS)]
Grammar = Annotated[str, Field(min_length=1, max_length=L.MAX_GRAMMAR_CHARS, pattern=r"\S")]
Choices = Annotated[list[Annotated[str, Field(min_length=1, max_length=L.MAX_GUIDED_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=L.MAX_GUIDED_CHOICES)]
_SCHEMA_NOTE = f"a JSON schema: an object of at most {L.MAX_SCHEMA_CHARS} characters as compact JSON, or its JSON text"
JsonSchema = dict[str, Any] | Annotated[str, Field(max_length=L.MAX_SCHEMA_CHARS)]


def json_chars(value: Any) -> int:
    """Characters of value's compact JSON text (the measure of the object-valued bounds)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _bounded_schema(value: Any, limit: int = L.MAX_SCHEMA_CHARS) -> Any:
    """A field validator's body: refuse a schema object over `limit` characters of JSON."""
    if isinstance(value, dict) and json_chars(value) > limit:
        raise ValueError(f"the schema is larger than {limit} characters as JSON")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(default="response", pattern=_NAME)
    description: Description | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema", description=_SCHEMA_NOTE)
    strict: bool | None = None

    _schema_size = field_validator("schema_")(_bounded_schema)


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object), or
    "json_schema" (output valid against json_schema.schema; `strict` is accepted: the output
    always follows the schema here)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's extension (extra_body): one of json (a schema), regex, choice, grammar (Lark or
    GBNF), json_object."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: JsonSchema | None = Field(default=None, alias="json", description=_SCHEMA_NOTE)
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None

    _schema_size = field_validator("json_")(_bounded_schema)


class _GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    # The bounds below are the ones shared.sampling.SamplingParams enforces, stated in the
    # schema so that the served OpenAPI document agrees with what is refused (400).
    max_tokens: int | None = Field(None, ge=1, le=L.MAX_TOKENS)  # None = up to the default cap
    temperature: float | None = Field(None, ge=0, le=100)   # None = 1.0 (OpenAI's default)
    top_p: float | None = Field(None, gt=0, le=1)           # None = 1.0
    top_k: int | None = Field(None, ge=-1)       # extension (vLLM's): None or -1 disables
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # strings; ints are taken as stop token ids
    stop: StopString | Annotated[list[StopString | TokenId], Field(max_length=L.MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=L.MAX_STOP_TOKEN_IDS)  # extension (vLLM's)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    ignore_eos: bool = False               # extension: generate past EOS (benchmarks)
    presence_penalty: float | None = Field(None, ge=-2, le=2)   # None = 0
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)  # extension (vLLM's): None = 1.0 (off)
    min_tokens: int | None = Field(None, ge=0)                   # extension (vLLM's): None = 0
    # token id (as a string) -> bias
    logit_bias: dict[Annotated[str, Field(max_length=16)], Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=L.MAX_LOGIT_BIAS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None   # extension (vLLM's)
    guided_json: JsonSchema | None = Field(None, description=_SCHEMA_NOTE)   # extensions (vLLM's older names)
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None
    speculative: bool | None = None        # extension: false opts out of speculative decoding
    # labels only: accepted, ignored (they do not change the output)
    user: Name | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=L.MAX_METADATA)
    store: bool | None = None
    service_tier: Annotated[str, Field(max_length=64)] | None = None
    # would change the output, not supported: a non-empty value is a 400 naming it
    prediction: Any = None

    _schema_size = field_validator("guided_json")(_bounded_schema)

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
        if self.prediction is not None:
            raise InvalidRequestError("prediction (predicted outputs) is not supported", "prediction")
        if self.constraint() is not None:
            for name in ("ignore_eos", "min_tokens"):   # a grammar ends where EOS is its only way on
                if getattr(self, name):
                    raise InvalidRequestError(f"{name} cannot be combined with an output constraint", name)

    def constraint(self) -> tuple[str, Any, str] | None:
        """(kind, value, parameter) of the output constraint (shared.constraints.KINDS), or None.
        More than one is a 400."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("json_object", None, "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise InvalidRequestError("response_format json_schema needs a json_schema object", "response_format")
            found.append(("json_schema", rf.json_schema.schema_, "response_format"))
        so = self.structured_outputs
        if so is not None:
            for kind, value in (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar)):
                if value is not None:
                    found.append((kind, value, "structured_outputs"))
            if so.json_object:
                found.append(("json_object", None, "structured_outputs"))
        for kind, name in (("json_schema", "guided_json"), ("regex", "guided_regex"),
                           ("choice", "guided_choice"), ("grammar", "guided_grammar")):
            if getattr(self, name) is not None:
                found.append((kind, getattr(self, name), name))
        if len(found) > 1:
            names = ", ".join(f[2] for f in found)
            raise InvalidRequestError(f"at most one output constraint per request (got {names})", found[1][2])
        return found[0] if found else None

    def logit_bias_pairs(self, vocab_size: int) -> list[tuple[int, float]]:
        """logit_bias as (token id, bias) pairs; 400 for an id outside [0, vocab_size)."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= tid < vocab_size:
                raise InvalidRequestError(f"logit_bias token id {tid} is outside the vocabulary [0, {vocab_size})",
                                          "logit_bias")
            pairs.append((tid, bias))
        return pairs

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or the number of top alternatives per token."""
        return None

    def sampling(self, max_tokens: int, constraint: str | None = None,
                 logit_bias: list[tuple[int, float]] = ()) -> SamplingParams:
        """Validated sampling parameters (raises InvalidRequestError naming the field).
        constraint: the compiled grammar (the gateway's), logit_bias: checked pairs."""
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=-1 if self.top_k is None else self.top_k,
                              max_tokens=max_tokens, seed=self.seed,
                              stop_token_ids=self.all_stop_token_ids(), ignore_eos=self.ignore_eos,
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              min_tokens=self.min_tokens or 0, logprobs=self.num_logprobs(),
                              logit_bias=list(logit_bias), constraint=constraint,
                              speculative=self.speculative is not False)


_TOKEN_IDS = {"type": "array", "minItems": 1, "maxItems": L.MAX_PROMPT_TOKEN_IDS,
              "items": {"type": "integer", "minimum": 0, "maximum": _INT32}}
_PROMPT_TEXT = {"type": "string", "minLength": 1, "maxLength": L.MAX_TEXT_CHARS}
TokenIds = Annotated[list[TokenId], Field(max_length=L.MAX_PROMPT_TOKEN_IDS)]
# what prompts() accepts: no empty prompt in any form (token ids must also be < the vocabulary size)
Prompt = Annotated[Text | Annotated[list[Text], Field(max_length=L.MAX_PROMPTS)] | TokenIds
                   | Annotated[list[TokenIds], Field(max_length=L.MAX_PROMPTS)], WithJsonSchema({"anyOf": [
                       _PROMPT_TEXT,
                       {"type": "array", "minItems": 1, "maxItems": L.MAX_PROMPTS, "items": _PROMPT_TEXT},
                       _TOKEN_IDS,
                       {"type": "array", "minItems": 1, "maxItems": L.MAX_PROMPTS, "items": _TOKEN_IDS}]})]


class CompletionRequest(_GenerationFields):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None
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
    type: Annotated[str, Field(max_length=64)]
    text: Text | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Name
    arguments: Annotated[str, Field(max_length=L.MAX_ARGUMENTS_CHARS)] = "{}"   # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Name | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=L.MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=L.MAX_TOOL_CALLS)  # assistant: its calls
    tool_call_id: Name | None = None                    # tool: the call this result answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise InvalidRequestError("only text content parts are supported", "messages")
        return "".join(p.text or "" for p in self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=_NAME)
    description: Description | None = None
    # a JSON schema of the arguments; None: no arguments
    parameters: dict[str, Any] | None = Field(None, description=_SCHEMA_NOTE)
    strict: bool | None = None

    _schema_size = field_validator("parameters")(_bounded_schema)


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: Name


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=L.MAX_MESSAGES, description=(
        f"at most {L.MAX_MESSAGES} messages with at most {L.MAX_TEXT_CHARS} characters of text in all"))
    max_completion_tokens: int | None = Field(None, ge=1, le=L.MAX_TOKENS)
    logprobs: bool | None = None
    # with logprobs unset, top_logprobs turns logprobs on; logprobs=false turns both off
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=L.MAX_TOOLS, description=(
        f"at most {L.MAX_TOOLS} tools of at most {L.MAX_TOOLS_CHARS} characters as JSON in all"))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None     # None = true (OpenAI's default)
    # would change the output, not supported: a non-empty value is a 400 naming it
    functions: list[Any] | None = Field(None, max_length=L.MAX_TOOLS)   # the deprecated form of tools
    function_call: Any = None
    modalities: list[Annotated[str, Field(max_length=16)]] | None = Field(None, max_length=4)  # only ["text"]
    audio: Any = None

    @field_validator("messages")
    @classmethod
    def _text_bound(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        total = 0
        for m in messages:
            parts = [m.content] if isinstance(m.content, str) else [p.text or "" for p in m.content or ()]
            total += sum(len(t) for t in parts) + sum(len(c.function.arguments) for c in m.tool_calls or ())
            if total > L.MAX_TEXT_CHARS:
                raise ValueError(f"the messages have more than {L.MAX_TEXT_CHARS} characters of text")
        return messages

    @field_validator("tools")
    @classmethod
    def _tools_bound(cls, tools: list[Tool] | None) -> list[Tool] | None:
        if tools and json_chars([t.model_dump(exclude_none=True) for t in tools]) > L.MAX_TOOLS_CHARS:
            raise ValueError(f"the tools are larger than {L.MAX_TOOLS_CHARS} characters as JSON")
        return tools

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                                          "top_logprobs")
        for name in ("functions", "function_call", "audio"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} is not supported" + (
                    " (use tools and tool_choice)" if name.startswith("function") else ""), name)
        if self.modalities and any(m != "text" for m in self.modalities):
            raise InvalidRequestError("only the text modality is supported", "modalities")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                                      "tool_choice")
        if self.tool_mode() in ("required", "named") and self.constraint() is not None:
            raise InvalidRequestError("tool_choice required or a named function cannot be combined with "
                                      "another output constraint", "tool_choice")

    def tool_mode(self) -> str:
        """"none" | "auto" | "required" | "named" (see gateway.tools)."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return "none"
        if isinstance(choice, NamedToolChoice):
            return "named"
        return choice or "auto"

    def num_logprobs(self) -> int | None:
        """logprobs=true: top_logprobs alternatives (0 when unset); logprobs unset: on when
        top_logprobs is given (it asks for them); logprobs=false: off."""
        on = self.logprobs if self.logprobs is not None else self.top_logprobs is not None
        return (self.top_logprobs or 0) if on else None

    def template_messages(self, tool_calls_as_text: bool = False) -> list[dict[str, Any]]:
        """The messages as chat templates take them. "developer" is the newer name of "system"
        (templates know the latter). An assistant's tool_calls go as the templates of tool-using
        models expect them (arguments parsed); tool_calls_as_text: as `<tool_call>` blocks in
        its content instead (templates without tool support, gateway.tools.FALLBACK_PROMPT)."""
        out = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                calls = [{"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                         for c in m.tool_calls]
                if tool_calls_as_text:
                    msg["content"] = (msg["content"] + "".join(
                        "\n<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                         "arguments": c["function"]["arguments"]})
                        + "\n</tool_call>" for c in calls)).strip()
                else:
                    msg["tool_calls"] = calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


def _json_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s
