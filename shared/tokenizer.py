"""The model's tokenizer and chat template, from a GGUF file's metadata or a Hugging Face dir.

Built from library parts only: the BPE itself is the `tokenizers` library's (a GGUF's vocab and
merges are fed to `tokenizers.models.BPE`), chat templates are rendered with jinja2 the way
`transformers` renders them. Torch-free, so the gateway does not pay for importing torch.

Control tokens (the vocabulary's special tokens: `<|im_start|>`, `<|eot_id|>`...) in a chat come
from the template only: text of the messages or tools that spells one is tokenized as plain text,
so a client cannot forge a turn or a role (encode_chat; `parse_control_tokens` restores the old
behaviour for trusted clients).

Encoding a long text releases the GIL (the `tokenizers` batch call does; its single call does
not), so a long prompt tokenized on a worker thread does not stall the event loop of the server.
A short one takes the single call: the batch call hands work to a thread pool, which costs more
than the GIL is held for a short text.
"""
from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from shared.model_source import ModelSource

# GGUF token types (llama.cpp's llama_token_type): CONTROL tokens are special.


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its own raise_exception, e.g. roles out of order):
    the message is the template author's, meant for the client."""

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


@dataclass
class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    eos_token_ids: every id that ends generation (the GGUF/config EOS, plus the chat template's
    end-of-turn token when it is a distinct special token).
    """

    backend: HFTokenizer
    chat_template: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; control tokens spelled in it are control tokens (a raw prompt is
        the client's whole input). add_special_tokens: BOS as the model wants it."""
        ids = _encode(self.backend, text, add_special_tokens)
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos = self.backend.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None, *,
                    parse_control_tokens: bool = False) -> list[int]:
        """Prompt ids of a chat. The template writes any BOS itself, so none is added here.

        Every control token of the result is one the template wrote: a control token's text in a
        message or a tool definition is tokenized as text (as if the vocabulary had no such
        token). parse_control_tokens=True (trusted clients) tokenizes the rendered text as a
        whole instead, so such text becomes the control token. Both give the same ids when no
        message spells a control token."""
        if parse_control_tokens or self._controls is None or not self._spells_control([messages, tools]):
            return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)
        spelled: dict[str, str] = {}
        marker = secrets.token_hex(4)

        def escape(value: Any) -> Any:
            if isinstance(value, str):
                def hide(m: re.Match) -> str:
                    key = f"\ue000{marker}{len(spelled)}\ue001"
                    spelled[key] = m.group(0)
                    return key
                return self._controls.sub(hide, value)
            if isinstance(value, dict):
                return {k: escape(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [escape(v) for v in value]
            return value

        rendered = self.apply_chat_template(escape(messages), tools=escape(tools))
        restore = re.compile("|".join(re.escape(k) for k in spelled))
        ids: list[int] = []
        pos = 0
        for m in self._controls.finditer(rendered):  # the template's own control tokens
            ids += self._encode_text(restore.sub(lambda k: spelled[k.group(0)], rendered[pos:m.start()]))
            ids.append(self.backend.token_to_id(m.group(0)))
            pos = m.end()
        return ids + self._encode_text(restore.sub(lambda k: spelled[k.group(0)], rendered[pos:]))

    def warm(self) -> None:
        """Build what encode_chat makes on first need (the control-token pattern, the text-only
        copy of the backend: about 0.1 s) now, so that no request pays for it."""
        if self._controls is not None:
            self._text_backend  # noqa: B018 - a cached property: built here

    def _spells_control(self, value: Any) -> bool:
        """Whether any string in value (nested lists and dicts) spells a control token."""
        if isinstance(value, str):
            return self._controls.search(value) is not None
        if isinstance(value, dict):
            return any(self._spells_control(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(self._spells_control(v) for v in value)
        return False

    @functools.cached_property
    def _controls(self) -> re.Pattern | None:
        """Matches any control (special) token's text, longest first; None: the vocabulary has none."""
        names = sorted({t.content for t in self.backend.get_added_tokens_decoder().values() if t.special},
                       key=len, reverse=True)
        return re.compile("|".join(re.escape(n) for n in names)) if names else None

    @functools.cached_property
    def _text_backend(self) -> HFTokenizer:
        """A copy of the backend that reads control tokens' text as plain text."""
        backend = HFTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def _encode_text(self, text: str) -> list[int]:
        return _encode(self._text_backend, text, False) if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render a chat with the model's template (the prompt text, not yet tokenized). tools:
        OpenAI tool definitions, for templates that render them (as transformers passes them)."""
        if not self.chat_template:
            # A base model: plain "role: content" lines, so chat still works, visibly unformatted.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of a resolved model (see shared.model_source.resolve_model)."""
    if source.kind == "gguf":
        return _from_gguf(Path(source.path))
    return _from_hf_dir(Path(source.path))


# --------------------------------------------------------------------------------------------
GIL_FREE_CHARS = 4096   # texts at least this long are encoded with the GIL released


def _encode(backend: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) < GIL_FREE_CHARS:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    """Compiled once per template: every chat request renders it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return env.from_string(template)


def _end_of_turn_ids(backend: HFTokenizer, template: str | None, eos_id: int | None) -> list[int]:
    ids = [eos_id] if eos_id is not None else []
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = backend.token_to_id(marker)
        if tid is not None and template and marker in template and tid not in ids:
            ids.append(tid)
    return ids


def _from_gguf(path: Path) -> Tokenizer:
    from shared.gguf_file import GgufFile  # numpy-only

    fields = GgufFile(path).fields

    def get(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path.name}: tokenizer type {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = get("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges")]
    types = get("tokenizer.ggml.token_type", [1] * len(tokens))
    backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if get("tokenizer.ggml.pre") in ("smollm", "llama-bpe", "qwen2", "starcoder"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))  # llama.cpp splits \p{N} first
    backend.pre_tokenizer = pre_tokenizers.Sequence(pre)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED)])
    bos_id, eos_id = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    template = get("tokenizer.chat_template")
    return Tokenizer(
        backend=backend, chat_template=template,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        eos_token_ids=_end_of_turn_ids(backend, template, eos_id))


def _token_str(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _from_hf_dir(path: Path) -> Tokenizer:
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no tokenizer.json")
    backend = HFTokenizer.from_file(str(tj))
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
    eos_id = backend.token_to_id(eos) if eos else None
    ids = _end_of_turn_ids(backend, template, eos_id)
    for name in ("generation_config.json", "config.json"):  # the model's own EOS ids count too
        p = path / name
        extra = json.loads(p.read_text()).get("eos_token_id") if p.is_file() else None
        for i in ([extra] if isinstance(extra, int) else extra or []):
            if i not in ids:
                ids.append(i)
    # tokenizer.json's own post-processor adds BOS where the model wants it (Llama), so
    # add_bos stays False here: it is only for GGUF backends, which have no post-processor.
    return Tokenizer(backend=backend, chat_template=template, bos_token=bos, eos_token=eos, eos_token_ids=ids)
