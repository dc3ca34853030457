"""kvgate's priority classes passed on to vLLM's priority scheduling (`priority_to_backend`).

vLLM started with `--scheduling-policy priority` serves lower values of the body's `priority`
first. With the setting on, a request that says its class in X-Kvgate-Priority and sets no
`priority` of its own reaches the backend with high -1 / low 1 as the first member of its
body, the rest of its bytes unchanged; one that sets `priority` is forwarded as it came (its
raising still needs the priority token). Off (the default), bodies are never touched.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from faultkit import RecordingBackend, recording_backend, served_gateway
from hypothesis import given
from hypothesis import strategies as st

from gateway.admission import Priority
from gateway.prepare import with_backend_priority

TOKEN = "operator-token"


@pytest.fixture
def backend() -> Iterator[tuple[RecordingBackend, str]]:
    with recording_backend() as pair:
        yield pair


def forwarded(backend: RecordingBackend) -> bytes:
    return backend.generation()[-1].body


@pytest.mark.parametrize("enabled", [True, False])
def test_the_class_reaches_vllm_as_its_priority_only_when_asked(
    backend: tuple[RecordingBackend, str], enabled: bool
) -> None:
    recorder, url = backend
    with served_gateway(url, priority_to_backend=enabled, priority_token=TOKEN) as kvgate:
        body = b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}'
        cases = [
            ({"x-kvgate-priority": "low"}, 1),
            ({"x-kvgate-priority": "high", "x-kvgate-priority-token": TOKEN}, -1),
            ({"x-kvgate-priority": "normal"}, None),
            ({}, None),
        ]
        for headers, expected in cases:
            answer = httpx.post(
                f"{kvgate.url}/v1/completions",
                content=body,
                headers={"content-type": "application/json", **headers},
                timeout=10,
            )
            assert answer.status_code == 200, answer.text
            sent = forwarded(recorder)
            if enabled and expected is not None:
                assert json.loads(sent) == {**json.loads(body), "priority": expected}
                assert sent.endswith(body[1:])  # the client's own bytes follow, unchanged
            else:
                assert sent == body
        # A body that sets vLLM's priority itself is forwarded as it came.
        own = b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "priority": 5}'
        answer = httpx.post(
            f"{kvgate.url}/v1/completions",
            content=own,
            headers={"content-type": "application/json", "x-kvgate-priority": "low"},
            timeout=10,
        )
        assert answer.status_code == 200
        assert forwarded(recorder) == own


@given(
    members=st.dictionaries(st.text(min_size=1).filter(lambda k: k != "priority"), st.integers(), max_size=4),
    spaces=st.sampled_from(["", " ", "\n\t "]),
    priority=st.sampled_from(list(Priority)),
)
def test_the_priority_is_spliced_into_any_object(
    members: dict[str, int], spaces: str, priority: Priority
) -> None:
    raw = (spaces + json.dumps(members) + spaces).encode()
    spliced = with_backend_priority(raw, priority)
    expected = {"high": -1, "normal": None, "low": 1}[priority.value]
    if expected is None:
        assert spliced == raw
    else:
        assert json.loads(spliced) == {"priority": expected, **members}
