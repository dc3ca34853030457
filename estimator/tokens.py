"""Exact prompt token counts for OpenAI-style request bodies, the way vLLM counts them.

`TokenCounter.count(route, body)` returns what vLLM will report as `usage.prompt_tokens` for the
same body: for chat requests it renders the model's chat template exactly as vLLM's OpenAI server
does (message normalisation, content parts, tools, documents, template kwargs, generation prompt)
and tokenizes the result without special tokens unless the request asks for them; for completions
it tokenizes each prompt with special tokens, or counts the token ids it is given. Asked for a
block size, it also hashes the full blocks of the first prompt's token ids (estimator.prefix), so
that a router can tell which backend may still cache the prompt's beginning.

Counting is synchronous, CPU-bound and thread-safe without a lock: every thread that counts has
a copy of the tokenizer of its own (see `TokenCounter.prepare_thread`), so a large body being
counted in the service's thread pool never makes a small one wait on the event loop.
Without a tokenizer the counter still answers, approximately, and says so (`exact=False`).

A chat template sent with the request (`chat_template`, or `chat_template` inside
`chat_template_kwargs`) is code from the client. Like vLLM by default, the counter refuses it
(400) unless told to trust it; a trusted one is rendered by a `TemplateSandbox` (another process,
with bounds on time, memory and output: gateway.render_pool) and only counted here. Whatever a
template raises, the model's own included, is the request's failure: a 400, never a 500.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

if TYPE_CHECKING:
    from concurrent.futures import Executor

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from estimator.media import MEDIA_MARKUP_TOKENS, MediaProfile, Modality
from estimator.prefix import chained_block_hashes

# Without a tokenizer, text is counted as UTF-8 bytes over this ratio: about right for English
# BPE vocabularies and deliberately on the high side for code and non-Latin scripts.
APPROX_BYTES_PER_TOKEN = 3.0
# Per-message overhead of a typical chat template, for approximate counts only.
APPROX_TOKENS_PER_MESSAGE = 4
# Tokens reserved per media item whose bound is "the rest of the context" when the context
# length is not known either (a counter built without max_model_len).
MEDIA_TOKENS_UNKNOWN_CONTEXT = 32_768

# A text longer than this many characters per token of the context is first tokenized by its
# beginning (see TokenCounter._encode_ids). Joining text after a cut can merge a few tokens at
# the cut; past the margin, the whole text surely holds more tokens than the beginning's count
# minus the margin, hence more than the context.
PROBE_CHARS_PER_CONTEXT_TOKEN = 8
PROBE_MARGIN_TOKENS = 64

ContentFormat = Literal["auto", "string", "openai"]

# vLLM 0.32's answer to a request template it was not told to trust (400, BadRequestError),
# with its flag named as kvgate's setting.
UNTRUSTED_TEMPLATE_MESSAGE = (
    "Chat template is passed with request, but trust_request_chat_template is not set. "
    "Refused request with untrusted chat template."
)
# An exception's text can be as long as the template makes it (raise_exception(huge)); the
# client gets this much of it.
TEMPLATE_ERROR_MAX_CHARS = 300


class Route(StrEnum):
    """The OpenAI endpoint a body was sent to."""

    CHAT = "chat"
    COMPLETIONS = "completions"


class RequestBodyError(ValueError):
    """The body cannot be a valid request: the service answers 400 with `param` named."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ChatTemplateError(RequestBodyError):
    """A chat template cannot be used for this request: refused, it raised, or it exceeded a
    bound. A 400 like any RequestBodyError, with an error `code` that says which."""

    def __init__(self, message: str, param: str | None, code: str) -> None:
        super().__init__(message, param)
        self.code = code


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A chat body's prompt as its template rendered it, and how to count it: with special
    tokens or not, its media items (counted apart, see `TokenCounter._with_media`), and the
    `max_length` the template kwargs cut it at (None: not cut)."""

    prompt: str
    add_special_tokens: bool
    media: tuple[MediaItem, ...] = ()
    max_length: int | None = None


class TemplateSandbox(Protocol):
    """Renders chat bodies that carry their own template where that template cannot harm the
    caller: another process, bounded in time, memory and output size.

    `render_chat(body)` returns what `TokenCounter.render_chat` returns for `body` in a counter
    that trusts request templates. It blocks until the render ends or a bound stops it; it is
    thread-safe; it raises RequestBodyError (a ChatTemplateError when the template failed or
    exceeded a bound). Call it on `executor`, whose threads only wait for the sandbox, so that a
    slow template never holds a thread that tokenizes other requests. `close()` stops whatever
    the sandbox started; it may start again on the next render."""

    @property
    def executor(self) -> Executor: ...

    def render_chat(self, body: Mapping[str, Any]) -> RenderedChat | int: ...

    def close(self) -> None: ...


# What a counter does with a template sent in the request: refuse it (vLLM's default), render
# it in this process (only where this process is the sandbox), or hand it to a sandbox.
RequestTemplates: TypeAlias = Literal["refuse", "render"] | TemplateSandbox


def request_chat_template(body: Mapping[str, Any]) -> str | None:
    """Where `body` carries a chat template of its own ("chat_template" or
    "chat_template_kwargs.chat_template"), or None. Present means not None, as vLLM checks: an
    empty string counts."""
    if body.get("chat_template") is not None:
        return "chat_template"
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping) and kwargs.get("chat_template") is not None:
        return "chat_template_kwargs.chat_template"
    return None


def template_failure(exc: BaseException) -> ChatTemplateError:
    """What a template's exception means to the client (vLLM answers 400 the same way)."""
    detail = str(exc)
    if len(detail) > TEMPLATE_ERROR_MAX_CHARS:
        detail = detail[:TEMPLATE_ERROR_MAX_CHARS] + "..."
    what = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    if isinstance(exc, MemoryError | RecursionError):
        return ChatTemplateError(
            f"the chat template exceeded kvgate's bounds ({what})", "messages", "chat_template_too_costly"
        )
    return ChatTemplateError(
        f"the chat template rejected the request ({what})", "messages", "chat_template_error"
    )


@dataclass(frozen=True, slots=True)
class PromptCount:
    """Prompt tokens of one request. A completions request may carry several prompts, each of
    which vLLM runs as its own sequence; `tokens` is their sum.

    `block_hashes` are the chained hashes (estimator.prefix) of the full blocks of the first
    prompt's token ids, at the block size `TokenCounter.count` was asked for. Empty when not
    asked, or when the ids vLLM will run are not known: counted approximately (no tokenizer or
    no template), with media parts (their placeholder tokens are equal for different media), a
    text too long for the context (only its beginning was tokenized), or a prompt truncated
    (`truncate_prompt_tokens` or the template's `max_length`)."""

    per_prompt: tuple[int, ...]
    exact: bool
    block_hashes: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(self.per_prompt)

    @property
    def longest(self) -> int:
        return max(self.per_prompt, default=0)


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the counter uses."""

    chat_template: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


# ---------------------------------------------------------------- body validation helpers


def _expect_list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise RequestBodyError(f"'{param}' must be an array", param)
    return value


def _expect_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestBodyError(f"'{key}' must be a boolean", key)
    return value


def _is_token_ids(value: Any) -> bool:
    # The element types are collected in C (a genexpr over a million ids took 0.5 s of a
    # tokenizer thread holding the interpreter lock, against tens of ms this way).
    return (
        isinstance(value, list)
        and bool(value)
        and all(issubclass(kind, int) and not issubclass(kind, bool) for kind in set(map(type, value)))
    )


# ---------------------------------------------------------------- chat normalisation

# Content part types as vLLM 0.32 parses them (vllm/renderers/chat_utils.py, MM_PARSER_MAP):
# text-like parts and the key holding their text, media parts and their modality.
_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# vLLM skips these when their text is null or missing (PART_TYPES_TO_SKIP_NONE_CONTENT).
_SKIP_NONE_PART_TYPES = frozenset({"text", "refusal"})
_MEDIA_PART_TYPES = {
    "image_url": Modality.IMAGE,
    "input_image": Modality.IMAGE,
    "image_pil": Modality.IMAGE,
    "image_embeds": Modality.IMAGE,
    "audio_url": Modality.AUDIO,
    "input_audio": Modality.AUDIO,
    "audio_embeds": Modality.AUDIO,
    "video_url": Modality.VIDEO,
    "video_embeds": Modality.VIDEO,
}
_KNOWN_PART_TYPES = (
    frozenset(_TEXT_PART_KEYS) | frozenset(_MEDIA_PART_TYPES) | {"prompt_embeds", "tool_reference"}
)
# A part without a `type` (or with a `uuid`) is typed by the first of these keys it holds.
_UNTYPED_PART_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
# Typed media parts whose value vLLM validates as {"url": str, ...}.
_URL_PART_TYPES = frozenset({"image_url", "audio_url", "video_url"})
# vLLM drops the first line of system text that starts with this (Claude Code's attribution
# header changes on every request and would defeat the prefix cache).
_BILLING_HEADER = "x-anthropic-billing-header"


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One image, audio or video part of a chat body; `param` says where it is."""

    modality: Modality
    part_type: str
    param: str
    url: str | None = None  # an image's URL, whose data may say its size


@dataclass(frozen=True, slots=True)
class _Content:
    template_content: Any  # what the chat template sees: a string or a list of part dicts
    texts: list[str]
    media: list[MediaItem]


def _part_type(part: Mapping[str, Any], where: str) -> str:
    """The type vLLM gives a content part, or RequestBodyError where vLLM answers 400."""
    part_type = part.get("type")
    if isinstance(part_type, str) and part_type in _KNOWN_PART_TYPES and part.get("uuid") is None:
        return part_type
    if part_type is None or part.get("uuid") is not None:
        for key in _UNTYPED_PART_KEYS:
            if key in part:
                return key
        raise RequestBodyError(f"'{where}' has no 'type' field and no media field", f"{where}.type")
    if not isinstance(part_type, str):
        raise RequestBodyError(f"'{where}.type' must be a string", f"{where}.type")
    supported = ", ".join(sorted(_KNOWN_PART_TYPES))
    raise RequestBodyError(
        f"unsupported chat content part type {part_type!r} at '{where}'; supported types: {supported}",
        f"{where}.type",
    )


def _parse_content(
    content: Any,
    param: str,
    role: str,
    content_format: Literal["string", "openai"],
    media: MediaProfile,
) -> _Content:
    """A message's content as vLLM hands it to the template, with its media items.

    Media parts the served model cannot take are refused here (vLLM answers 400 for them), so
    that they never reach the queue; the others are counted by the caller, never as zero."""
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    else:
        parts = _expect_list(content, param)
    texts: list[str] = []
    items: list[Any] = []  # openai format: part dicts in order
    found: list[MediaItem] = []
    for index, part in enumerate(parts):
        where = param if isinstance(content, str) else f"{param}[{index}]"
        if isinstance(part, str):
            text: str | None = part
        elif isinstance(part, Mapping):
            part_type = _part_type(part, where)
            text = None
            if part_type in _TEXT_PART_KEYS:
                key = _TEXT_PART_KEYS[part_type]
                value = part.get(key)
                if value is None and part_type in _SKIP_NONE_PART_TYPES:
                    continue
                if not isinstance(value, str):
                    raise RequestBodyError(f"'{where}.{key}' must be a string", f"{where}.{key}")
                text = value
            elif part_type == "tool_reference":
                # Not media: the template expands the referenced tool.
                name = part.get("name")
                if content_format == "openai":
                    items.append({"type": "tool_reference", "name": name})
                elif isinstance(name, str) and name:
                    texts.append(name)
                continue
            elif part_type == "prompt_embeds":
                raise RequestBodyError(
                    f"'{where}' is a prompt_embeds part: vLLM takes them only when started with "
                    "--enable-prompt-embeds, and the gateway cannot count them",
                    where,
                )
            else:
                found.append(_media_item(part, part_type, where, media))
                if content_format == "openai":
                    items.append({"type": _MEDIA_PART_TYPES[part_type].value})
                continue
        else:
            raise RequestBodyError(f"'{where}' must be an object or a string", where)
        if text is None:
            continue
        if role == "system" and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        texts.append(text)
        if content_format == "openai":
            items.append({"type": "text", "text": text})
    template_content: Any
    if content_format == "openai":
        template_content = items
        if role == "tool" and all(item["type"] == "text" for item in items):
            # vLLM flattens text-only tool results to a string whatever the template expects.
            template_content = "\n".join(texts)
    else:
        template_content = "\n".join(texts)
    return _Content(template_content, texts, found)


def _media_item(part: Mapping[str, Any], part_type: str, where: str, media: MediaProfile) -> MediaItem:
    modality = _MEDIA_PART_TYPES[part_type]
    if media.rule(modality) is None:
        if not media.multimodal:
            raise RequestBodyError(
                f"'{where}' is a content part of type '{part_type}', but the served model is not "
                "a multimodal model: it takes text only",
                where,
            )
        raise RequestBodyError(
            f"'{where}' is a content part of type '{part_type}', but the served model takes no {modality} input",
            where,
        )
    if part_type in _URL_PART_TYPES and part.get("type") == part_type:
        value = part.get(part_type)
        if not isinstance(value, Mapping) or not isinstance(value.get("url"), str):
            raise RequestBodyError(
                f"'{where}.{part_type}' must be an object with a 'url' string", f"{where}.{part_type}"
            )
    url: Any = part.get("image_url") if part_type in ("image_url", "input_image") else None
    if isinstance(url, Mapping):
        url = url.get("url")
    return MediaItem(modality, part_type, where, url if isinstance(url, str) else None)


def _normalise_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to the template: its pydantic models dumped back to dicts, so
    absent optional fields appear as None and unknown fields are dropped."""
    if tools is None:
        return None
    result = []
    for index, tool in enumerate(_expect_list(tools, "tools")):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise RequestBodyError(f"'tools[{index}]' must be an object with a 'function'", f"tools[{index}]")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str):
            raise RequestBodyError(
                f"'tools[{index}].function.name' must be a string", f"tools[{index}].function.name"
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise RequestBodyError(
                f"'tools[{index}].function.parameters' must be an object",
                f"tools[{index}].function.parameters",
            )
        dumped: dict[str, Any] = {
            "name": name,
            "description": function.get("description"),
            "parameters": parameters,
        }
        if function.get("strict") is not None:
            dumped["strict"] = function["strict"]
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": dumped}
        result.append(entry)
    return result


def _tool_calls_for_template(tool_calls: Any, param: str) -> list[dict[str, Any]]:
    """Assistant tool calls with their `arguments` decoded to objects, as vLLM hands them to
    templates; arguments that are empty, malformed or not an object become {} as in vLLM."""
    calls: list[dict[str, Any]] = []
    for index, item in enumerate(_expect_list(tool_calls, param)):
        where = f"{param}[{index}]"
        function = item.get("function") if isinstance(item, Mapping) else None
        if (
            not isinstance(item, Mapping)
            or item.get("type", "function") != "function"
            or not isinstance(function, Mapping)
        ):
            raise RequestBodyError(f"'{where}' must be a function tool call object", where)
        arguments = function.get("arguments")
        parsed: Any = {}
        if isinstance(arguments, Mapping):
            parsed = dict(arguments)
        elif isinstance(arguments, str) and arguments:
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = {}
        if not isinstance(parsed, dict):
            parsed = {}
        # vLLM validates each call into OpenAI's typed dicts, which keeps only the declared keys
        # and re-orders them as declared (id, function{arguments, name}, type); templates that
        # print calls as JSON show that order.
        call: dict[str, Any] = {}
        if "id" in item:
            call["id"] = item["id"]
        call["function"] = {"arguments": parsed, "name": function.get("name")}
        call["type"] = item.get("type", "function")
        calls.append(call)
    return calls


@dataclass(frozen=True, slots=True)
class _Conversation:
    messages: list[dict[str, Any]]
    texts: list[str]  # every text the messages hold, for approximate counts
    media: list[MediaItem]


def _normalise_messages(
    messages: Any, content_format: Literal["string", "openai"], media: MediaProfile
) -> _Conversation:
    """Messages as vLLM passes them to the chat template (vllm/renderers/chat_utils.py)."""
    items = _expect_list(messages, "messages")
    if not items:
        raise RequestBodyError("'messages' must not be empty", "messages")
    conversation: list[dict[str, Any]] = []
    texts: list[str] = []
    found: list[MediaItem] = []
    for index, message in enumerate(items):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise RequestBodyError(f"'{where}' must be an object", where)
        role = message.get("role")
        if not isinstance(role, str):
            raise RequestBodyError(f"'{where}.role' must be a string", f"{where}.role")
        parsed = _parse_content(message.get("content"), f"{where}.content", role, content_format, media)
        texts.extend(parsed.texts)
        found.extend(parsed.media)
        entry: dict[str, Any] = {"role": role, "content": parsed.template_content}
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if tool_calls is not None:
                calls = _tool_calls_for_template(tool_calls, f"{where}.tool_calls")
                if calls:
                    entry["tool_calls"] = calls
            # vLLM renames the deprecated `reasoning_content` to `reasoning` before parsing.
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                entry["reasoning"] = reasoning
                entry["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            entry["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        if isinstance(message.get("task"), str):
            entry["task"] = message["task"]
        if role == "developer":
            entry["tools"] = message.get("tools")
        conversation.append(entry)
    return _Conversation(conversation, texts, found)


def detect_content_format(chat_template: str) -> Literal["string", "openai"]:
    """Whether a template iterates over message content parts ("openai") or prints content as
    one string ("string"), judged from the template's syntax tree as vLLM does."""
    try:
        tree = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return "string"
    message_names = {
        loop.target.name
        for loop in tree.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and _refers_to(loop.iter, "messages")
    }
    for loop in tree.find_all(jinja2.nodes.For):
        if any(_refers_to(loop.iter, name, "content") for name in message_names):
            return "openai"
    return "string"


def _refers_to(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """`name`, or `name[key]` / `name.key`, possibly behind filters, tests and slices."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        return _refers_to(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _refers_to(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _refers_to(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _refers_to(node.node, name) and node.attr == key
    return False


def _needs_developer_conversion(messages: list[dict[str, Any]], chat_template: str) -> bool:
    """vLLM turns developer messages into system ones for a template that never names the role
    (renderers/hf.py _detect_developer_role_support)."""
    named = '"developer"' in chat_template or "'developer'" in chat_template
    return not named and any(message["role"] == "developer" for message in messages)


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as system ones, all system messages merged into one at the front when
    one is not already alone there (vLLM's _convert_developer_to_system and
    _consolidate_system_messages)."""
    converted = []
    for message in messages:
        if message["role"] == "developer":
            message = {**message, "role": "system"}
            message.pop("tools", None)
        converted.append(message)
    system_texts: list[str] = []
    others: list[dict[str, Any]] = []
    consolidate = False
    for index, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        if index > 0 or system_texts:
            consolidate = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part if isinstance(part, str) else part["text"]
                for part in content
                if isinstance(part, str) or (isinstance(part, Mapping) and "text" in part)
            )
        if content:
            system_texts.append(content)
    if not consolidate:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


# ---------------------------------------------------------------- template kwargs

# vLLM treats these values as "not given" when it merges kwargs (renderers/params.py merge_kwargs).
_UNSET_VALUES: tuple[object, ...] = (None, "auto")


def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    return {**defaults, **{k: v for k, v in overrides.items() if not _is_unset(v)}}


def _is_unset(value: Any) -> bool:
    return any(value is unset or (isinstance(value, str) and value == unset) for unset in _UNSET_VALUES)


def _template_kwargs(
    user: Mapping[str, Any],
    *,
    tools: list[dict[str, Any]] | None,
    documents: Any,
    add_generation_prompt: bool,
    continue_final_message: bool,
    reasoning_effort: Any,
) -> dict[str, Any]:
    """The chat template's keyword arguments, merged exactly as vLLM 0.32 merges them.

    ChatCompletionRequest.build_chat_params lays the request's own fields over
    `chat_template_kwargs` (add_generation_prompt and continue_final_message always win, as they
    always have a value; documents and reasoning_effort win when given); the serving layer then
    lays the result over its defaults, which hold the request's `tools` and `tokenize=False`,
    so `tools` and `tokenize` inside chat_template_kwargs win over the request's. A None or "auto"
    value never overrides anything."""
    extra: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "reasoning_effort": reasoning_effort,
    }
    if reasoning_effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = reasoning_effort != "none"
    defaults: dict[str, Any] = {"tokenize": False}
    if tools is not None:
        defaults["tools"] = tools
    return _merge(defaults, _merge(dict(user), extra))


class _GenerationTag(jinja2.ext.Extension):
    """Parses `{% generation %}...{% endgeneration %}` as Hugging Face templates use it, so that
    templates with it parse (for their variable names only; nothing is rendered here)."""

    tags = {"generation"}  # noqa: RUF012  (jinja2 declares it an instance attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def template_variables(chat_template: str) -> frozenset[str] | None:
    """The names a chat template reads from its context, or None when it does not parse."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(chat_template)))
    except jinja2.TemplateSyntaxError:
        return None


def _named_parameters(function: Any) -> frozenset[str]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(
        p.name
        for p in parameters
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    )


def _load_media_profile(sources: Sequence[str | Path]) -> MediaProfile:
    """The model's media profile from the config.json (and processor config) of the first source,
    a local folder or a model id in the local Hugging Face cache, that has one; unknown when none
    has (every modality is then taken and bounded by the context)."""
    for source in sources:
        config = _read_model_json(source, "config.json")
        if config is not None:
            return MediaProfile.from_config(config, _read_model_json(source, "preprocessor_config.json"))
    return MediaProfile.unknown()


def _read_model_json(path_or_id: str | Path, filename: str) -> dict[str, Any] | None:
    folder = Path(path_or_id)
    path: Path | None = folder / filename if folder.is_dir() else None
    if path is None:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        cached = try_to_load_from_cache(str(path_or_id), filename)
        path = Path(cached) if isinstance(cached, str) else None
    if path is None or not path.is_file():
        return None
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


# ---------------------------------------------------------------- the counter


class TokenCounter:
    """Counts prompt tokens for chat and completions bodies with the model's own tokenizer."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        *,
        chat_template: str | None = None,
        content_format: ContentFormat = "auto",
        max_model_len: int | None = None,
        media: MediaProfile | None = None,
        request_templates: RequestTemplates = "refuse",
        max_prompt_chars: int | None = None,
    ) -> None:
        # Never used to count: each thread counts with a deep copy of it (see `_own_tokenizer`).
        self._tokenizer = tokenizer
        # What the served model does with media parts; unknown without its config.json.
        self._media = media if media is not None else MediaProfile.unknown()
        # Fast tokenizers mutate internal state on every call, so one shared by threads fails
        # with "Already borrowed" or needs a lock; a lock lets a large body counted in the pool
        # make the event loop wait. One copy per thread needs neither. Keyed by thread id (not
        # threading.local) so that the event loop's copy can be made ahead, in the pool.
        self._copies: dict[int, Any] = {}
        self._chat_template = chat_template
        self._max_model_len = max_model_len
        self._request_templates: RequestTemplates = request_templates
        # Past this many characters a rendered prompt is refused before it is tokenized.
        self._max_prompt_chars = max_prompt_chars
        self._content_format_option: ContentFormat = content_format
        template = chat_template or (getattr(tokenizer, "chat_template", None) if tokenizer else None)
        if content_format == "auto":
            self._content_format: Literal["string", "openai"] = (
                detect_content_format(template) if isinstance(template, str) else "string"
            )
        else:
            self._content_format = content_format
        self._has_template = isinstance(template, str) and bool(template)
        # The largest token id the model knows: vLLM refuses a prompt with a larger one.
        vocab = getattr(tokenizer, "get_vocab", None)
        ids = vocab().values() if callable(vocab) else ()
        self._max_token_id: int | None = max(ids, default=None)
        # The keyword arguments the tokenizer's apply_chat_template names: vLLM passes a request's
        # chat_template_kwargs on only when the template or this signature names them.
        render = getattr(tokenizer, "apply_chat_template", None)
        self._render_params = _named_parameters(render) if render is not None else frozenset()
        self._template_vars = template_variables(template) if isinstance(template, str) else None

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        *,
        content_format: ContentFormat = "auto",
        max_model_len: int | None = None,
        config_sources: Sequence[str | Path] = (),
        request_templates: RequestTemplates = "refuse",
        max_prompt_chars: int | None = None,
    ) -> TokenCounter:
        """Load a tokenizer from a model folder or a model id in the local Hugging Face cache
        (never from the network). Raises OSError when none can be loaded.

        The model's config.json, which says what media it takes, is read from the same place,
        else from the first of `config_sources` (other names of the served model) that has one."""
        from transformers import AutoTokenizer  # heavy import, kept off the CLI's fast path

        tokenizer = AutoTokenizer.from_pretrained(str(path_or_id), local_files_only=True)
        return cls(
            tokenizer,
            content_format=content_format,
            max_model_len=max_model_len,
            media=_load_media_profile([path_or_id, *config_sources]),
            request_templates=request_templates,
            max_prompt_chars=max_prompt_chars,
        )

    @classmethod
    def approximate(cls, *, max_model_len: int | None = None) -> TokenCounter:
        """A counter without a tokenizer: counts are estimates and say so."""
        return cls(None, max_model_len=max_model_len)

    @property
    def media(self) -> MediaProfile:
        return self._media

    @property
    def exact(self) -> bool:
        return self._tokenizer is not None

    @property
    def content_format(self) -> Literal["string", "openai"]:
        return self._content_format

    # tokenizer copies --------------------------------------------------------------------

    def prepare_thread(self, thread_id: int) -> None:
        """Make the tokenizer copy of thread `thread_id` now, from any thread: a copy takes
        about 0.3 s and 16 MB (testbed tokenizer), which the event loop must not spend inline."""
        if self._tokenizer is not None and thread_id not in self._copies:
            self._copies.setdefault(thread_id, copy.deepcopy(self._tokenizer))

    @property
    def tokenizer_copies(self) -> int:
        """How many threads have a tokenizer copy of their own."""
        return len(self._copies)

    def _own_tokenizer(self) -> Any:
        """This thread's copy of the tokenizer (made on its first use). No other thread ever
        uses it, so no lock is needed; a thread id reused after its thread ended inherits a copy
        that nobody else holds."""
        thread_id = threading.get_ident()
        tokenizer = self._copies.get(thread_id)
        if tokenizer is None:
            self.prepare_thread(thread_id)
            tokenizer = self._copies[thread_id]
        return tokenizer

    def _encode(self, text: str, add_special_tokens: bool) -> int:
        return len(self._encode_ids(text, add_special_tokens))

    def _encode_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._encode_ids_whole(text, add_special_tokens)[0]

    def _encode_ids_whole(self, text: str, add_special_tokens: bool) -> tuple[list[int], bool]:
        """The token ids of `text`, or, for a text far longer than the context, the ids of a
        beginning that alone holds more tokens than the context: vLLM refuses (or truncates)
        such a prompt either way, and tokenizing megabytes of it would cost seconds of a
        tokenizer thread and a gigabyte of memory for nothing. The beginning doubles until it
        holds that many tokens or is the whole text, so a legitimate prompt costs at most
        twice its own tokenization. The flag says whether the ids are the whole text's."""
        tokenizer = self._own_tokenizer()
        limit = self._max_model_len
        if limit is not None:
            probe = PROBE_CHARS_PER_CONTEXT_TOKEN * limit
            while probe < len(text):
                head: list[int] = tokenizer.encode(text[:probe], add_special_tokens=add_special_tokens)
                if len(head) >= limit + PROBE_MARGIN_TOKENS:
                    return head, False
                probe *= 2
        ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids, True

    # request templates -------------------------------------------------------------------

    def screen(self, route: Route, body: Mapping[str, Any]) -> TemplateSandbox | None:
        """Check `body` for a chat template of its own before anything renders it: refused
        (ChatTemplateError, 400) unless request templates are trusted. Returns the sandbox that
        will render it, or None when the body is counted in this process."""
        if route is not Route.CHAT or not isinstance(body, Mapping):
            return None
        where = request_chat_template(body)
        if where is None:
            return None
        if self._request_templates == "refuse":
            raise ChatTemplateError(UNTRUSTED_TEMPLATE_MESSAGE, where, "untrusted_chat_template")
        if isinstance(self._request_templates, str) or self._tokenizer is None:
            return None  # rendered here (this process is the sandbox), or never rendered at all
        return self._request_templates

    def with_chat_template(self, template: str) -> TokenCounter:
        """This counter rendering with `template`, its content format detected from it as vLLM
        detects a request template's; it shares this counter's tokenizer copies."""
        clone = copy.copy(self)
        clone._chat_template = template
        clone._has_template = True
        clone._template_vars = template_variables(template)
        if self._content_format_option == "auto":
            clone._content_format = detect_content_format(template)
        return clone

    def close(self) -> None:
        """Stop what the sandbox started (if any); it starts again when next needed."""
        if not isinstance(self._request_templates, str):
            self._request_templates.close()

    def count(
        self, route: Route, body: Mapping[str, Any], *, block_size: int | None = None, seed: int = 0
    ) -> PromptCount:
        """Prompt tokens of `body` sent to `route`. Raises RequestBodyError for malformed bodies.

        With `block_size` (tokens per KV block, >= 1, else ValueError) the count also carries
        the chained hashes of the first prompt's full blocks from `seed` (estimator.prefix:
        prefix_seed), at most ceil(max_model_len / block_size) of them; see PromptCount for
        when there are none. They hash the very ids that were counted: nothing is tokenized
        twice."""
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {block_size}")
        if not isinstance(body, Mapping):
            raise RequestBodyError("the request body must be a JSON object")
        if route is Route.CHAT:
            counts, exact, first_ids = self._count_chat(body)
        else:
            counts, exact, first_ids = self._count_completions(body)
        truncated = self._truncate(body, counts)
        hashes: tuple[int, ...] = ()
        # A truncated prompt keeps one end or the other (the side depends on the request and
        # the tokenizer): its ids are not known for sure, so it claims no blocks.
        if block_size is not None and first_ids is not None and truncated[0] == counts[0]:
            max_blocks = None if self._max_model_len is None else -(-self._max_model_len // block_size)
            hashes = chained_block_hashes(first_ids, block_size, seed, max_blocks)
        return PromptCount(truncated, exact, hashes)

    def _truncate(self, body: Mapping[str, Any], counts: tuple[int, ...]) -> tuple[int, ...]:
        """vLLM keeps only the last `truncate_prompt_tokens` tokens (-1: max_model_len)."""
        limit = body.get("truncate_prompt_tokens")
        if limit is None:
            return counts
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < -1:
            raise RequestBodyError(
                "'truncate_prompt_tokens' must be an integer >= -1", "truncate_prompt_tokens"
            )
        if limit == -1:
            if self._max_model_len is None:
                return counts
            limit = self._max_model_len
        return tuple(min(count, limit) for count in counts)

    # chat ---------------------------------------------------------------------------------

    def _count_chat(self, body: Mapping[str, Any]) -> tuple[tuple[int, ...], bool, Sequence[int] | None]:
        """The count, whether it is exact, and the prompt's ids when they are those vLLM runs."""
        rendered = self.render_chat(body)
        if isinstance(rendered, int):
            return (rendered,), False, None
        ids, whole = self._encode_ids_whole(rendered.prompt, rendered.add_special_tokens)
        tokens = len(ids) if rendered.max_length is None else min(len(ids), rendered.max_length)
        if rendered.media:
            with_media, exact = self._with_media(tokens, ids, list(rendered.media), body)
            return (with_media,), exact, None
        return (tokens,), True, ids if whole and tokens == len(ids) else None

    def render_chat(self, body: Mapping[str, Any]) -> RenderedChat | int:
        """The prompt text of a chat body, or its approximate token count when there is no
        tokenizer or no template. A template sent with the request is refused unless trusted,
        and rendered by the sandbox when there is one (see `screen`)."""
        sandbox = self.screen(Route.CHAT, body)
        if sandbox is not None:
            return sandbox.render_chat(body)
        template = body.get("chat_template")
        if isinstance(template, str) and template and self._tokenizer is not None:
            try:
                renderer = self.with_chat_template(template)
            except Exception as exc:  # parsing a template (code) can recurse or exhaust memory too
                raise template_failure(exc) from exc
            return renderer._render_chat(body)
        return self._render_chat(body)

    def _render_chat(self, body: Mapping[str, Any]) -> RenderedChat | int:
        conversation = _normalise_messages(body.get("messages"), self._content_format, self._media)
        add_generation_prompt = _expect_bool(body, "add_generation_prompt", True)
        continue_final_message = _expect_bool(body, "continue_final_message", False)
        if add_generation_prompt and continue_final_message:
            raise RequestBodyError(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                "continue_final_message",
            )
        add_special_tokens = _expect_bool(body, "add_special_tokens", False)
        documents = body.get("documents")
        if documents is not None:
            _expect_list(documents, "documents")
        user_kwargs = body.get("chat_template_kwargs")
        if user_kwargs is None:
            user_kwargs = {}
        if not isinstance(user_kwargs, Mapping):
            raise RequestBodyError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        reasoning_effort = body.get("reasoning_effort")
        request_template = body.get("chat_template")
        if request_template is not None and not isinstance(request_template, str):
            raise RequestBodyError("'chat_template' must be a string", "chat_template")
        kwargs = _template_kwargs(
            user_kwargs,
            tools=_normalise_tools(body.get("tools")),
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            reasoning_effort=reasoning_effort,
        )
        tools = kwargs.pop("tools", None)
        tokenize = bool(kwargs.pop("tokenize", False))
        # The request's own template, else the server's, else one in the kwargs, else the
        # tokenizer's: vLLM's order (ChatParams.get_apply_chat_template_kwargs).
        template = request_template or self._chat_template or kwargs.pop("chat_template", None)
        kwargs.pop("chat_template", None)

        if self._tokenizer is None or not (self._has_template or template):
            return self._approximate_chat(conversation, tools)

        resolved = template if template is not None else getattr(self._tokenizer, "chat_template", None)
        if isinstance(resolved, str) and _needs_developer_conversion(conversation.messages, resolved):
            conversation = replace(conversation, messages=_developer_as_system(conversation.messages))
        own = template is None or template == self._chat_template
        variables = self._template_vars if own else template_variables(template)
        if variables is not None:
            # vLLM passes on only the kwargs the template or apply_chat_template names
            # (resolve_chat_template_kwargs); a stray key must not break the render here.
            kwargs = {k: v for k, v in kwargs.items() if k in variables or k in self._render_params}
        kwargs["return_dict"] = False
        render_kwargs: dict[str, Any] = {**kwargs, "tools": tools}
        if template is not None:
            render_kwargs["chat_template"] = template
        prompt = self._render(conversation.messages, render_kwargs)
        # With `tokenize` in the kwargs vLLM takes the template's own token ids, which never
        # get special tokens added (and are cut at max_length when asked).
        max_length = kwargs.get("max_length")
        cut = max_length if tokenize and kwargs.get("truncation") and isinstance(max_length, int) else None
        return RenderedChat(prompt, add_special_tokens and not tokenize, tuple(conversation.media), cut)

    def _render(self, messages: list[dict[str, Any]], render_kwargs: dict[str, Any]) -> str:
        """Apply the chat template in this process. A template is code: whatever it raises
        (raise_exception, 1/0, RecursionError, MemoryError, ...) is the request's failure, a
        400 as in vLLM, never a 500 of kvgate's."""
        try:
            prompt = self._own_tokenizer().apply_chat_template(messages, tokenize=False, **render_kwargs)
        except Exception as exc:
            raise template_failure(exc) from exc
        if not isinstance(prompt, str):
            raise ChatTemplateError(
                "the chat template did not render text", "messages", "chat_template_error"
            )
        if self._max_prompt_chars is not None and len(prompt) > self._max_prompt_chars:
            raise ChatTemplateError(
                f"the chat template rendered {len(prompt)} characters, more than kvgate's bound of "
                f"{self._max_prompt_chars}",
                "messages",
                "chat_template_too_costly",
            )
        return prompt

    def _with_media(
        self, text_tokens: int, ids: Sequence[int] | None, media: list[MediaItem], body: Mapping[str, Any]
    ) -> tuple[int, bool]:
        """The prompt with its media items counted, and whether that count is exact.

        An image whose size is in the body (a data URL) counts exactly where the model's resize
        formula and processor config are known (estimator/media.py); every other item counts at
        its bound. The placeholder a template rendered for an item is replaced by the item's
        tokens, so it is taken out once per item. An item without a formula, or processor kwargs
        from the request that may change the items' size, reserves the rest of the context. A
        bound never takes the prompt past the longest one vLLM accepts (max_model_len - 1)
        unless the text alone does, so that it never makes the gateway refuse what vLLM serves."""
        total = text_tokens
        exact = ids is not None
        processor_kwargs = body.get("mm_processor_kwargs") is not None
        unbounded = processor_kwargs
        by_modality = Counter(item.modality for item in media)
        for modality, count in by_modality.items():
            rule = self._media.rule(modality)
            if rule is None:  # refused while parsing; kept for the type checker
                continue
            hits = 0
            if ids is not None and rule.placeholder_token_id is not None:
                hits = min(count, sum(1 for token in ids if token == rule.placeholder_token_id))
                total -= hits
            if hits < count:
                exact = False  # a placeholder we cannot see: its own tokens stay in the text
            for item in media:
                if item.modality is not modality:
                    continue
                tokens = None if processor_kwargs else rule.exact_tokens(item.url)
                if tokens is not None:
                    total += tokens
                    continue
                exact = False
                if rule.tokens_per_item is None:
                    unbounded = True
                else:
                    total += rule.tokens_per_item
            if self._content_format == "string":
                # vLLM puts the model's placeholder text beside the message text itself.
                total += count * MEDIA_MARKUP_TOKENS
                exact = False
        ceiling = self._max_model_len - 1 if self._max_model_len else None
        if ceiling is None:
            return total + (
                len(media) * MEDIA_TOKENS_UNKNOWN_CONTEXT if unbounded else 0
            ), exact and not unbounded
        if text_tokens > ceiling:
            return text_tokens, False
        if unbounded:
            return ceiling, False
        return min(max(total, text_tokens), ceiling), exact and total <= ceiling

    def _approximate_chat(self, conversation: _Conversation, tools: Any) -> int:
        messages = conversation.messages
        text_bytes = sum(len(text.encode()) for text in conversation.texts)
        for message in messages:
            if "tool_calls" in message:
                text_bytes += len(json.dumps(message["tool_calls"]).encode())
        if tools:
            text_bytes += len(json.dumps(tools, default=str).encode())
        tokens = math.ceil(text_bytes / APPROX_BYTES_PER_TOKEN) + APPROX_TOKENS_PER_MESSAGE * (
            len(messages) + 1
        )
        if conversation.media:
            return self._with_media(tokens, None, conversation.media, {})[0]
        return tokens

    # completions --------------------------------------------------------------------------

    def _count_completions(
        self, body: Mapping[str, Any]
    ) -> tuple[tuple[int, ...], bool, Sequence[int] | None]:
        """The counts, whether they are exact, and the first prompt's ids when they are known
        (token ids are known without a tokenizer too)."""
        if body.get("prompt_embeds") is not None:
            # Their length is in a serialized tensor the gateway does not decode; vLLM refuses
            # them unless started with --enable-prompt-embeds.
            raise RequestBodyError(
                "'prompt_embeds' needs a backend started with --enable-prompt-embeds, and the "
                "gateway cannot count it",
                "prompt_embeds",
            )
        if "prompt" not in body or body["prompt"] is None:
            raise RequestBodyError("'prompt' is required", "prompt")
        prompts = self._split_prompts(body["prompt"])
        add_special_tokens = _expect_bool(body, "add_special_tokens", True)
        counts: list[int] = []
        exact = True
        first_ids: Sequence[int] | None = None
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, list):
                self._check_token_ids(prompt, "prompt" if len(prompts) == 1 else f"prompt[{index}]")
                counts.append(len(prompt))
                if index == 0:
                    first_ids = prompt
            elif self._tokenizer is None:
                counts.append(max(1, math.ceil(len(prompt.encode()) / APPROX_BYTES_PER_TOKEN)))
                exact = False
            elif index == 0:
                ids, whole = self._encode_ids_whole(prompt, add_special_tokens)
                counts.append(len(ids))
                first_ids = ids if whole else None
            else:
                counts.append(self._encode(prompt, add_special_tokens))
        return tuple(counts), exact, first_ids

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        lowest, highest = min(ids), max(ids)
        if lowest < 0:
            raise RequestBodyError(f"'{param}' holds a negative token id ({lowest})", param)
        if self._max_token_id is not None and highest > self._max_token_id:
            raise RequestBodyError(
                f"'{param}' holds token id {highest}, beyond the model's vocabulary "
                f"(the largest id is {self._max_token_id})",
                param,
            )

    @staticmethod
    def _split_prompts(prompt: Any) -> Sequence[str | list[int]]:
        """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestBodyError("'prompt' must not be empty", "prompt")
            return [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestBodyError(
                "'prompt' must be a string, an array of strings, an array of token ids, "
                "or an array of arrays of token ids",
                "prompt",
            )
        if _is_token_ids(prompt):
            return [prompt]
        prompts: list[str | list[int]] = []
        for index, item in enumerate(prompt):
            if (isinstance(item, str) and item) or _is_token_ids(item):
                prompts.append(item)
            else:
                raise RequestBodyError(
                    f"'prompt[{index}]' must be a non-empty string or a non-empty array of token ids",
                    f"prompt[{index}]",
                )
        return prompts
