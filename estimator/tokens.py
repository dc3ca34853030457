"""Exact prompt token counts for OpenAI-style request bodies, the way vLLM counts them.

`TokenCounter.count(route, body)` returns what vLLM will report as `usage.prompt_tokens` for the
same body: for chat requests it renders the model's chat template exactly as vLLM's OpenAI server
does (message normalisation, content parts, tools, documents, template kwargs, generation prompt)
and tokenizes the result without special tokens unless the request asks for them; for completions
it tokenizes each prompt with special tokens, or counts the token ids it is given.

Counting is synchronous, CPU-bound and thread-safe: the service runs it in a bounded thread pool.
Without a tokenizer the counter still answers, approximately, and says so (`exact=False`).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, Protocol

import jinja2
import jinja2.nodes

# Without a tokenizer, text is counted as UTF-8 bytes over this ratio: about right for English
# BPE vocabularies and deliberately on the high side for code and non-Latin scripts.
APPROX_BYTES_PER_TOKEN = 3.0
# Per-message overhead of a typical chat template, for approximate counts only.
APPROX_TOKENS_PER_MESSAGE = 4

ContentFormat = Literal["auto", "string", "openai"]


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
    ) -> None:
        self._tokenizer = tokenizer
        # Fast tokenizers mutate internal state on every call; concurrent calls from several
        # threads can fail with "Already borrowed". A lock keeps counting safe in a thread pool.
        self._lock = threading.Lock()
        self._chat_template = chat_template
        self._max_model_len = max_model_len
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
    ) -> TokenCounter:
        """Load a tokenizer from a model folder or a model id in the local Hugging Face cache
        (never from the network). Raises OSError when none can be loaded."""
        from transformers import AutoTokenizer  # heavy import, kept off the CLI's fast path

        tokenizer = AutoTokenizer.from_pretrained(str(path_or_id), local_files_only=True)
        return cls(tokenizer, content_format=content_format, max_model_len=max_model_len)

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
            return (self._approximate_chat(conversation.messages, tools),), False

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
        with self._lock:
            try:
                prompt = self._tokenizer.apply_chat_template(
                    conversation.messages, tokenize=False, **render_kwargs
                )
            except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
                # vLLM answers 400 when the template rejects the conversation.
                raise RequestBodyError(f"the chat template rejected the messages: {exc}", "messages") from exc
            if not isinstance(prompt, str):
                raise RequestBodyError("the chat template did not render text", "messages")
            tokens = len(self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return (tokens,), not conversation.dropped_non_text

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
                with self._lock:
                    counts.append(len(self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens)))
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
