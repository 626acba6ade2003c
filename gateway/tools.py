"""Tool calling: what the prompt says about the tools, what constrains the output, and how the
output becomes OpenAI `tool_calls` (whole, or as streamed deltas).

tool_choice (default "auto" when tools are given, else "none"):
* "none": the tools are not shown to the model; the answer is text.
* "required": the output is constrained (shared.constraints) to a JSON array of one or more
  {"name", "arguments"} objects, each valid against its tool's `parameters` (one at most when
  parallel_tool_calls is false), so even a small model returns valid calls.
* a named function: the output is constrained to that tool's `parameters`; it is the call's
  arguments.
* "auto": no constraint; the model decides. Its text is read by the parser of its chat
  template's tool format (ToolParser: HermesParser for Hermes/Qwen-style `<tool_call>` blocks,
  Llama3JsonParser for Llama-3's bare JSON object). A template with no tool support gets the
  tools in a system message (FALLBACK_PROMPT, asking for `<tool_call>` blocks) and the Hermes
  parser.

Streamed, a call arrives as OpenAI streams it: a first fragment with index, id, type and name
(arguments ""), then argument fragments; the last chunk's finish_reason is "tool_calls". With a
named function the arguments stream as they are generated; with "required" and "auto" a call is
sent once its text is complete (text before a possible tool call streams as content at once).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

FALLBACK_PROMPT = """You can call these tools (functions), given as JSON schemas of their arguments:
{tools}
To call tools, answer only with one block per call, each holding a JSON object with the tool's name and its arguments:
<tool_call>
{{"name": "<tool name>", "arguments": {{<the arguments>}}}}
</tool_call>
If no tool is needed, answer the user directly."""


@dataclass
class ToolCall:
    name: str
    arguments: str          # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """Reads tool calls out of a model's text in one template format."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside tool calls, None when empty; the calls, in order)."""
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """Where in `text` (so far) a tool call may start: text before it can be streamed as
        content; len(text) when no call can have started."""
        raise NotImplementedError


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters" if args_key == "arguments" else "arguments", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5 / 3,
    and this server's fallback prompt); an unclosed last block counts if its JSON is whole."""

    START, END = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, rest, pos = [], [], 0
        for m in self._block.finditer(text):
            try:
                call = _call(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue        # not a call after all: it stays in the content
            calls.append(call)
            rest.append(text[pos:m.start()])
            pos = m.end()
        rest.append(text[pos:])
        content = "".join(rest).strip()
        return (content or None) if calls else (text or None), calls

    def hold_from(self, text: str) -> int:
        i = text.find(self.START)
        if i >= 0:
            return i
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):     # a marker cut mid-way
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonParser(ToolParser):
    """Llama 3.x's JSON tool calls: the whole answer is {"name": ..., "parameters": {...}} (several
    separated by ";"); `<|python_tag|>` is a special token, already dropped from the text."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if not body.startswith("{"):
            return text or None, []
        calls = []
        decoder, i = json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return text or None, []
            call = _call(obj, "parameters")
            if call is None:
                return text or None, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def hold_from(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) - len(stripped) if not stripped or stripped.startswith("{") else len(text)


def parser_for_template(template: str | None) -> ToolParser:
    """The parser of a chat template's tool-call format (Hermes when it has none: the fallback
    prompt asks for Hermes blocks)."""
    if template and "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return Llama3JsonParser()
    return HermesParser()


def template_has_tools(template: str | None) -> bool:
    """True when the chat template renders a `tools` list itself."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def fallback_system_prompt(tools: list[dict]) -> str:
    return FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The constraint of tool_choice "required": an array of {"name", "arguments"} calls, each
    valid against its tool; the tools' $defs are merged at the root (where "#/$defs/..." points)."""
    variants, defs = [], {}
    for t in tools:
        fn = t["function"]
        params = dict(fn.get("parameters") or {"type": "object"})
        defs.update(params.pop("$defs", {}) or {})
        variants.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": fn["name"]}, "arguments": params}})
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def calls_from_required(text: str) -> list[ToolCall] | None:
    """The calls of a "required" answer (the JSON array its constraint forces), or None when the
    text is not one (cut by max_tokens)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [_call(x) for x in items] if isinstance(items, list) else []
    return calls if calls and all(calls) else None


@dataclass
class ToolPlan:
    """How one chat request uses its tools. mode: "none" | "auto" | "required" | "named"."""

    mode: str
    tools: list[dict]
    name: str | None = None            # the named function
    parser: ToolParser | None = None   # "auto"

    def answer(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a whole answer."""
        if self.mode == "named" and finish_reason == "stop":
            return None, [ToolCall(self.name, text)], "tool_calls"
        if self.mode == "required" and finish_reason == "stop":
            calls = calls_from_required(text)
            if calls:
                return None, calls, "tool_calls"
        if self.mode == "auto":
            content, calls = self.parser.extract(text)
            if calls:
                return content, calls, "tool_calls"
        return text, [], finish_reason

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One streamed choice: text deltas in, OpenAI chat `delta` dicts out."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text, self.sent = plan, "", 0     # sent: characters streamed as content
        self.call: ToolCall | None = None                 # the named call, once announced

    def feed(self, text: str) -> list[dict]:
        self.text += text
        plan = self.plan
        if plan.mode == "named":
            out = []
            if self.call is None:
                self.call = ToolCall(plan.name, "")
                out.append(_call_delta(0, self.call, ""))
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if plan.mode == "auto":
            upto = plan.parser.hold_from(self.text)
            if upto > self.sent:
                piece, self.sent = self.text[self.sent:upto], upto
                return [{"content": piece}]
        return []       # "required": sent whole at the end

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas and the finish_reason, once the generation ended."""
        plan = self.plan
        if plan.mode == "named":
            return [], ("tool_calls" if finish_reason == "stop" else finish_reason)
        content, calls, reason = plan.answer(self.text, finish_reason)
        out: list[dict] = []
        if calls:
            if content and plan.mode == "auto":     # content after the streamed part, if any
                already = self.text[:self.sent]
                extra = content[len(already):] if content.startswith(already) else ""
                if extra.strip():
                    out.append({"content": extra})
            for i, c in enumerate(calls):
                out.append(_call_delta(i, c, ""))
                out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
        elif len(self.text) > self.sent:
            out.append({"content": self.text[self.sent:]})
        return out, reason


def _call_delta(index: int, call: ToolCall, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": arguments}}]}
