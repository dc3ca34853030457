"""Exact prompt token counts for OpenAI-style request bodies, the way vLLM counts them.

`TokenCounter.count(route, body)` returns what vLLM will report as `usage.prompt_tokens` for the
same body: for chat requests it renders the model's chat template exactly as vLLM's OpenAI server
does (message normalisation, content parts, tools, documents, template kwargs, generation prompt)
and tokenizes the result without special tokens unless the request asks for them; for completions
it tokenizes each prompt with special tokens, or counts the token ids it is given.

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
import json
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

if TYPE_CHECKING:
    from concurrent.futures import Executor

import jinja2
import jinja2.nodes

# Without a tokenizer, text is counted as UTF-8 bytes over this ratio: about right for English
# BPE vocabularies and deliberately on the high side for code and non-Latin scripts.
APPROX_BYTES_PER_TOKEN = 3.0
# Per-message overhead of a typical chat template, for approximate counts only.
APPROX_TOKENS_PER_MESSAGE = 4

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
    """A chat body's prompt as its template rendered it, and how to tokenize it. `exact` is
    False when non-text parts were dropped (the count is then a lower bound)."""

    prompt: str
    add_special_tokens: bool
    exact: bool


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
    which vLLM runs as its own sequence; `tokens` is their sum."""

    per_prompt: tuple[int, ...]
    exact: bool

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
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


# ---------------------------------------------------------------- chat normalisation

_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})


def _text_parts(content: Any, param: str) -> tuple[list[str], bool]:
    """The text of a message's content, and whether anything else (images, audio) was dropped."""
    if content is None:
        return [], False
    if isinstance(content, str):
        return [content], False
    parts = _expect_list(content, param)
    texts: list[str] = []
    non_text = False
    for index, part in enumerate(parts):
        where = f"{param}[{index}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise RequestBodyError(f"'{where}' must be an object or a string", where)
        part_type = part.get("type")
        if not isinstance(part_type, str):
            raise RequestBodyError(f"'{where}.type' must be a string", f"{where}.type")
        if part_type in _TEXT_PART_TYPES:
            key = "refusal" if part_type == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise RequestBodyError(f"'{where}.{key}' must be a string", f"{where}.{key}")
            texts.append(text)
        else:
            non_text = True
    return texts, non_text


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
    dropped_non_text: bool


def _normalise_messages(messages: Any, content_format: Literal["string", "openai"]) -> _Conversation:
    """Messages as vLLM passes them to the chat template (vllm/renderers/chat_utils.py)."""
    items = _expect_list(messages, "messages")
    if not items:
        raise RequestBodyError("'messages' must not be empty", "messages")
    conversation: list[dict[str, Any]] = []
    dropped = False
    for index, message in enumerate(items):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise RequestBodyError(f"'{where}' must be an object", where)
        role = message.get("role")
        if not isinstance(role, str):
            raise RequestBodyError(f"'{where}.role' must be a string", f"{where}.role")
        texts, non_text = _text_parts(message.get("content"), f"{where}.content")
        dropped = dropped or non_text
        content: Any
        if content_format == "openai":
            content = [{"type": "text", "text": text} for text in texts]
        else:
            content = "\n".join(texts)
        if role == "tool" and isinstance(content, list):
            # vLLM flattens text-only tool results to a string whatever the template expects.
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if tool_calls is not None:
                calls = _tool_calls_for_template(tool_calls, f"{where}.tool_calls")
                if calls:
                    entry["tool_calls"] = calls
            reasoning = message.get("reasoning")
            if reasoning is not None:
                entry["reasoning"] = reasoning
                entry["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            entry["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        conversation.append(entry)
    return _Conversation(conversation, dropped)


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
        request_templates: RequestTemplates = "refuse",
        max_prompt_chars: int | None = None,
    ) -> None:
        # Never used to count: each thread counts with a deep copy of it (see `_own_tokenizer`).
        self._tokenizer = tokenizer
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

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        *,
        content_format: ContentFormat = "auto",
        max_model_len: int | None = None,
        request_templates: RequestTemplates = "refuse",
        max_prompt_chars: int | None = None,
    ) -> TokenCounter:
        """Load a tokenizer from a model folder or a model id in the local Hugging Face cache
        (never from the network). Raises OSError when none can be loaded."""
        from transformers import AutoTokenizer  # heavy import, kept off the CLI's fast path

        tokenizer = AutoTokenizer.from_pretrained(str(path_or_id), local_files_only=True)
        return cls(
            tokenizer,
            content_format=content_format,
            max_model_len=max_model_len,
            request_templates=request_templates,
            max_prompt_chars=max_prompt_chars,
        )

    @classmethod
    def approximate(cls) -> TokenCounter:
        """A counter without a tokenizer: counts are estimates and say so."""
        return cls(None)

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
        return len(self._own_tokenizer().encode(text, add_special_tokens=add_special_tokens))

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
        if self._content_format_option == "auto":
            clone._content_format = detect_content_format(template)
        return clone

    def close(self) -> None:
        """Stop what the sandbox started (if any); it starts again when next needed."""
        if not isinstance(self._request_templates, str):
            self._request_templates.close()

    def count(self, route: Route, body: Mapping[str, Any]) -> PromptCount:
        """Prompt tokens of `body` sent to `route`. Raises RequestBodyError for malformed bodies."""
        if not isinstance(body, Mapping):
            raise RequestBodyError("the request body must be a JSON object")
        if route is Route.CHAT:
            counts, exact = self._count_chat(body)
        else:
            counts, exact = self._count_completions(body)
        return PromptCount(self._truncate(body, counts), exact)

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

    def _count_chat(self, body: Mapping[str, Any]) -> tuple[tuple[int, ...], bool]:
        rendered = self.render_chat(body)
        if isinstance(rendered, int):
            return (rendered,), False
        return (self._encode(rendered.prompt, rendered.add_special_tokens),), rendered.exact

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
        conversation = _normalise_messages(body.get("messages"), self._content_format)
        add_generation_prompt = _expect_bool(body, "add_generation_prompt", True)
        continue_final_message = _expect_bool(body, "continue_final_message", False)
        if add_generation_prompt and continue_final_message:
            raise RequestBodyError(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                "continue_final_message",
            )
        add_special_tokens = _expect_bool(body, "add_special_tokens", False)
        tools = _normalise_tools(body.get("tools"))
        documents = body.get("documents")
        if documents is not None:
            _expect_list(documents, "documents")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, Mapping):
            raise RequestBodyError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        request_template = body.get("chat_template")
        if request_template is not None and not isinstance(request_template, str):
            raise RequestBodyError("'chat_template' must be a string", "chat_template")

        if self._tokenizer is None or not (self._has_template or request_template):
            return self._approximate_chat(conversation.messages, tools)

        render_kwargs: dict[str, Any] = {
            **kwargs,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        template = request_template or self._chat_template
        if template is not None:
            render_kwargs["chat_template"] = template
        prompt = self._render(conversation.messages, render_kwargs)
        return RenderedChat(prompt, add_special_tokens, not conversation.dropped_non_text)

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

    @staticmethod
    def _approximate_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        text_bytes = 0
        for message in messages:
            content = message["content"]
            if isinstance(content, list):
                text_bytes += sum(len(part["text"].encode()) for part in content)
            else:
                text_bytes += len(str(content).encode())
            if "tool_calls" in message:
                text_bytes += len(json.dumps(message["tool_calls"]).encode())
        if tools:
            text_bytes += len(json.dumps(tools).encode())
        return math.ceil(text_bytes / APPROX_BYTES_PER_TOKEN) + APPROX_TOKENS_PER_MESSAGE * (
            len(messages) + 1
        )

    # completions --------------------------------------------------------------------------

    def _count_completions(self, body: Mapping[str, Any]) -> tuple[tuple[int, ...], bool]:
        if "prompt" not in body or body["prompt"] is None:
            raise RequestBodyError("'prompt' is required", "prompt")
        prompts = self._split_prompts(body["prompt"])
        add_special_tokens = _expect_bool(body, "add_special_tokens", True)
        counts: list[int] = []
        exact = True
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, list):
                self._check_token_ids(prompt, "prompt" if len(prompts) == 1 else f"prompt[{index}]")
                counts.append(len(prompt))
            elif self._tokenizer is None:
                counts.append(max(1, math.ceil(len(prompt.encode()) / APPROX_BYTES_PER_TOKEN)))
                exact = False
            else:
                counts.append(self._encode(prompt, add_special_tokens))
        return tuple(counts), exact

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
