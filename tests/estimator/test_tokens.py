"""TokenCounter without a server: validation, fallbacks, template detection, thread safety."""

from __future__ import annotations

import base64
import shutil
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from estimator.media import MEDIA_MARKUP_TOKENS, MediaProfile, MediaRule, Modality, VisionGrid
from estimator.tokens import (
    MEDIA_TOKENS_UNKNOWN_CONTEXT,
    RequestBodyError,
    Route,
    TokenCounter,
    detect_content_format,
)


@pytest.fixture(scope="module")
def counter(tiny_model_dir: Path) -> TokenCounter:
    return TokenCounter.from_pretrained(tiny_model_dir)


BAD_BODIES: list[tuple[Route, Any, str | None]] = [
    (Route.CHAT, [], None),
    (Route.CHAT, {}, "messages"),
    (Route.CHAT, {"messages": "hi"}, "messages"),
    (Route.CHAT, {"messages": []}, "messages"),
    (Route.CHAT, {"messages": ["hi"]}, "messages[0]"),
    (Route.CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (Route.CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (Route.CHAT, {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
    ),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"},
        "add_generation_prompt",
    ),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
        "continue_final_message",
    ),
    (Route.CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "tools"),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        "tools[0]",
    ),
    (
        Route.CHAT,
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []},
        "chat_template_kwargs",
    ),
    (
        Route.CHAT,
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"type": "web"}]}]},
        "messages[0].tool_calls[0]",
    ),
    (Route.COMPLETIONS, {}, "prompt"),
    (Route.COMPLETIONS, {"prompt": None}, "prompt"),
    (Route.COMPLETIONS, {"prompt": ""}, "prompt"),
    (Route.COMPLETIONS, {"prompt": []}, "prompt"),
    (Route.COMPLETIONS, {"prompt": 42}, "prompt"),
    (Route.COMPLETIONS, {"prompt": ["ok", 3]}, "prompt[1]"),
    (Route.COMPLETIONS, {"prompt": [[1, 2], []]}, "prompt[1]"),
    (Route.COMPLETIONS, {"prompt": [True, False]}, "prompt[0]"),
    (Route.COMPLETIONS, {"prompt": [5, True, 7]}, "prompt[0]"),  # one boolean among the ids
    (Route.COMPLETIONS, {"prompt": [5, 7.0]}, "prompt[0]"),
    (Route.COMPLETIONS, {"prompt": [224, -19547, 1030]}, "prompt"),
    (Route.COMPLETIONS, {"prompt": ["ok", [5, -1]]}, "prompt[1]"),
    (Route.COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD_BODIES)
@pytest.mark.parametrize("exact", [True, False], ids=["tokenizer", "approximate"])
def test_malformed_bodies_raise_with_param(
    counter: TokenCounter, route: Route, body: Any, param: str | None, exact: bool
) -> None:
    chosen = counter if exact else TokenCounter.approximate()
    with pytest.raises(RequestBodyError) as error:
        chosen.count(route, body)
    assert error.value.param == param


def test_approximate_counts_say_so_and_scale_with_text() -> None:
    approx = TokenCounter.approximate()
    short = approx.count(Route.CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    long = approx.count(Route.CHAT, {"messages": [{"role": "user", "content": "hi " * 500}]})
    assert not short.exact
    assert 0 < short.tokens < long.tokens
    ids = approx.count(Route.COMPLETIONS, {"prompt": [[1, 2, 3], [4]]})
    assert ids.per_prompt == (3, 1)


def test_token_ids_and_several_prompts(counter: TokenCounter) -> None:
    count = counter.count(Route.COMPLETIONS, {"prompt": ["a b c", [5, 6, 7, 8]]})
    assert count.exact
    assert count.per_prompt[1] == 4
    assert count.tokens == sum(count.per_prompt)
    assert count.longest == max(count.per_prompt)


def test_token_ids_beyond_the_vocabulary_are_refused(counter: TokenCounter, tiny_model_dir: Path) -> None:
    largest = max(AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab().values())
    assert counter.count(Route.COMPLETIONS, {"prompt": [0, largest]}).tokens == 2
    with pytest.raises(RequestBodyError, match=f"token id {largest + 1}, beyond") as error:
        counter.count(Route.COMPLETIONS, {"prompt": [1, largest + 1]})
    assert error.value.param == "prompt"
    # Without the tokenizer there is no vocabulary to hold them to.
    assert TokenCounter.approximate().count(Route.COMPLETIONS, {"prompt": [largest + 1]}).tokens == 1


def test_truncation_keeps_the_limit(counter: TokenCounter) -> None:
    body = {"prompt": "word " * 100, "truncate_prompt_tokens": 7}
    assert counter.count(Route.COMPLETIONS, body).tokens == 7


PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
MEDIA_PARTS: list[dict[str, Any]] = [
    {"type": "image_url", "image_url": {"url": PNG}},
    {"type": "input_image", "image_url": PNG, "detail": "auto"},
    {"type": "image_pil", "image_pil": "x"},
    {"type": "image_embeds", "image_embeds": "AAAA"},
    {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "audio_embeds", "audio_embeds": "AAAA"},
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    {"type": "video_embeds", "video_embeds": "AAAA"},
    {"image_url": {"url": PNG}},  # untyped: typed by its media key, as vLLM does
    {"type": "text", "text": "x", "uuid": "u1", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
]


def _with_part(part: Any, text: str = "what is this?") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}, part]}]}


@pytest.mark.parametrize("part", MEDIA_PARTS, ids=lambda part: str(part.get("type", "untyped")))
def test_a_text_only_model_refuses_media_parts(counter: TokenCounter, part: dict[str, Any]) -> None:
    # The tiny model's config.json has no vision or audio tower: vLLM answers 400 for any media.
    assert not counter.media.multimodal
    with pytest.raises(RequestBodyError, match="not a multimodal model") as error:
        counter.count(Route.CHAT, _with_part(part))
    assert error.value.param == "messages[0].content[1]"


@pytest.mark.parametrize(
    ("part", "param", "message"),
    [
        ({"type": "file", "file": {"file_data": "AAAA"}}, "messages[0].content[1].type", "unsupported"),
        ({"type": "banana"}, "messages[0].content[1].type", "unsupported"),
        ({"type": 5}, "messages[0].content[1].type", "must be a string"),
        ({"text": "no type"}, "messages[0].content[1].type", "no 'type'"),
        ({"type": "text", "text": "x", "uuid": "u"}, "messages[0].content[1].type", "no 'type'"),
        ({"type": "prompt_embeds", "data": "AAAA"}, "messages[0].content[1]", "enable-prompt-embeds"),
    ],
)
@pytest.mark.parametrize("exact", [True, False], ids=["tokenizer", "approximate"])
def test_parts_vllm_refuses_are_refused(
    counter: TokenCounter, part: dict[str, Any], param: str, message: str, exact: bool
) -> None:
    chosen = counter if exact else TokenCounter.approximate()
    with pytest.raises(RequestBodyError, match=message) as error:
        chosen.count(Route.CHAT, _with_part(part))
    assert error.value.param == param


def test_completion_prompt_embeds_are_refused(counter: TokenCounter) -> None:
    with pytest.raises(RequestBodyError) as error:
        counter.count(Route.COMPLETIONS, {"prompt": "x", "prompt_embeds": "AAAA"})
    assert error.value.param == "prompt_embeds"


def _counter_for(
    tiny_model_dir: Path, media: MediaProfile, *, max_model_len: int | None = 100_000, **kwargs: Any
) -> TokenCounter:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return TokenCounter(tokenizer, media=media, max_model_len=max_model_len, **kwargs)


def test_a_media_item_counts_at_its_bound_and_says_so(tiny_model_dir: Path) -> None:
    media = MediaProfile({Modality.IMAGE: MediaRule(300)})
    multimodal = _counter_for(tiny_model_dir, media)
    text = multimodal.count(
        Route.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    )
    one = multimodal.count(Route.CHAT, _with_part(MEDIA_PARTS[0], "a"))
    two = multimodal.count(
        Route.CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, MEDIA_PARTS[0], MEDIA_PARTS[9]]}
            ]
        },
    )
    assert text.exact
    assert not one.exact
    assert not two.exact
    assert one.tokens == text.tokens + 300
    assert two.tokens == text.tokens + 600
    # The model takes no audio: refused, as vLLM refuses a modality the model has no tower for.
    with pytest.raises(RequestBodyError, match="takes no audio"):
        multimodal.count(Route.CHAT, _with_part(MEDIA_PARTS[4]))


def test_the_rendered_placeholder_is_not_counted_twice(tiny_model_dir: Path) -> None:
    # A template that renders one <unk> (id 0) per image, as VL templates render their image pad.
    template = (
        "{% for m in messages %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}<unk>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}"
    )
    media = MediaProfile({Modality.IMAGE: MediaRule(50, placeholder_token_id=0)})
    multimodal = _counter_for(tiny_model_dir, media, chat_template=template)
    text = multimodal.count(
        Route.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}]}
    )
    image = multimodal.count(Route.CHAT, _with_part(MEDIA_PARTS[0], "ab"))
    assert image.tokens == text.tokens + 50
    # Placeholder text typed by the client is the client's text, not an image: counted as such.
    typed = multimodal.count(Route.CHAT, _with_part(MEDIA_PARTS[0], "ab<unk><unk>"))
    assert typed.tokens == image.tokens + 2


def _png(width: int, height: int) -> str:
    """A data URL whose PNG header says width x height (the size is all the counter reads)."""
    ihdr = struct.pack(">II5B", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    idat = struct.pack(">I", 0) + b"IDAT" + struct.pack(">I", zlib.crc32(b"IDAT"))
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + chunk + idat).decode()


def test_an_image_of_known_size_counts_exactly(tiny_model_dir: Path) -> None:
    template = (
        "{% for m in messages %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}<unk>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}"
    )
    grid = VisionGrid(factor=28, min_pixels=3136, max_pixels=28 * 28 * 256)
    media = MediaProfile({Modality.IMAGE: MediaRule(256 + 8, placeholder_token_id=0, grid=grid)})
    multimodal = _counter_for(tiny_model_dir, media, chat_template=template)
    text = multimodal.count(
        Route.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}]}
    )
    part = {"type": "image_url", "image_url": {"url": _png(640, 480)}}
    count = multimodal.count(Route.CHAT, _with_part(part, "ab"))
    assert count.exact
    assert count.tokens == text.tokens + grid.tokens(640, 480)
    # A remote image has no size in the body: the bound, and the count says it is one.
    remote = multimodal.count(
        Route.CHAT, _with_part({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "ab")
    )
    assert not remote.exact
    assert remote.tokens == text.tokens + 264


def test_a_bound_never_passes_the_longest_prompt_vllm_accepts(tiny_model_dir: Path) -> None:
    media = MediaProfile({Modality.IMAGE: MediaRule(5_000), Modality.VIDEO: MediaRule(None)})
    capped = _counter_for(tiny_model_dir, media, max_model_len=1024)
    assert capped.count(Route.CHAT, _with_part(MEDIA_PARTS[0])).tokens == 1023
    # No formula for video: the rest of the context, whatever the item.
    assert capped.count(Route.CHAT, _with_part(MEDIA_PARTS[7])).tokens == 1023
    roomy = _counter_for(tiny_model_dir, media, max_model_len=1 << 20)
    assert roomy.count(Route.CHAT, _with_part(MEDIA_PARTS[7])).tokens == (1 << 20) - 1
    # A text that alone overflows the context keeps its own count, for vLLM's refusal.
    long_text = "word " * 1500
    text_only = capped.count(Route.CHAT, {"messages": [{"role": "user", "content": long_text}]}).tokens
    assert text_only > 1023
    assert capped.count(Route.CHAT, _with_part(MEDIA_PARTS[0], long_text)).tokens == text_only


def test_processor_kwargs_from_the_request_reserve_the_context(tiny_model_dir: Path) -> None:
    # mm_processor_kwargs may change an image's size (max_pixels): no bound holds then.
    media = MediaProfile({Modality.IMAGE: MediaRule(64)})
    multimodal = _counter_for(tiny_model_dir, media, max_model_len=2048)
    body = {**_with_part(MEDIA_PARTS[0]), "mm_processor_kwargs": {"max_pixels": 1 << 30}}
    assert multimodal.count(Route.CHAT, body).tokens == 2047


def test_without_a_model_config_media_reserve_the_rest_of_the_context() -> None:
    approx = TokenCounter.approximate(max_model_len=4096)
    count = approx.count(Route.CHAT, _with_part(MEDIA_PARTS[5]))
    assert count.tokens == 4095
    assert not count.exact
    # Without a context length either: a documented large allowance per item, never zero.
    bare = TokenCounter.approximate().count(Route.CHAT, _with_part(MEDIA_PARTS[0]))
    assert bare.tokens > MEDIA_TOKENS_UNKNOWN_CONTEXT


def test_the_model_folder_decides_what_media_count(
    tmp_path: Path, tiny_model_dir: Path, fixtures_dir: Path
) -> None:
    # The tiny tokenizer beside a Qwen2.5-VL config.json and processor config: a VL model folder.
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    configs = fixtures_dir / "configs" / "multimodal"
    shutil.copy(configs / "qwen2.5-vl-7b-instruct.json", tmp_path / "config.json")
    shutil.copy(
        configs / "qwen2.5-vl-7b-instruct.preprocessor_config.json", tmp_path / "preprocessor_config.json"
    )
    loaded = TokenCounter.from_pretrained(tmp_path, max_model_len=32_768)
    rule = loaded.media.rule(Modality.IMAGE)
    assert rule is not None
    assert rule.tokens_per_item == 12_845_056 // 28**2 + MEDIA_MARKUP_TOKENS
    text = loaded.count(
        Route.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    )
    # The 1x1 PNG data URL: resized to 56 x 56 by the processor config's min_pixels, 2 x 2 tokens.
    assert loaded.count(Route.CHAT, _with_part(MEDIA_PARTS[0], "a")).tokens == text.tokens + 4
    remote = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    assert loaded.count(Route.CHAT, _with_part(remote, "a")).tokens == text.tokens + rule.tokens_per_item
    assert loaded.media.rule(Modality.AUDIO) is None


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% for message in messages %}{% for c in message.content | selectattr('type') %}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for x in other %}{% endfor %}{% endfor %}", "string"),
        ("{% broken", "string"),
    ],
)
def test_content_format_detection(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_counting_is_thread_safe(counter: TokenCounter) -> None:
    bodies = [
        {"messages": [{"role": "user", "content": f"message number {i} " * (i % 17 + 1)}]} for i in range(200)
    ]
    serial = [counter.count(Route.CHAT, body).tokens for body in bodies]
    with ThreadPoolExecutor(max_workers=8) as pool:
        parallel = list(pool.map(lambda body: counter.count(Route.CHAT, body).tokens, bodies))
    assert parallel == serial


def test_missing_tokenizer_folder_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="nowhere"):
        TokenCounter.from_pretrained(tmp_path / "nowhere")
