"""`Client.inference` against a replica's real InferenceService pipeline (fixture models,
scripted engines) under mutual TLS."""

from __future__ import annotations

from typing import Any

import pytest

from inferplane.runtime.security.identity import ROUTER
from inferplane.sdk import Client, InvalidArgumentError, NotFoundError, PermissionDeniedError
from inferplane.wire import chat_request_from_dict

HELLO = {"model": "kimi-tiny", "messages": [{"role": "user", "content": "Capital of France?"}]}


@pytest.fixture
def replica(pki: Any, fx: Any) -> Any:
    with fx.running_replica(pki) as running:
        yield running


def test_chat_streamed_and_not(pki: Any, replica: Any, fx: Any) -> None:
    with Client(inference=replica.address, security=pki.security()) as client:
        response = client.inference.chat(HELLO)
        # The proto and OpenAI's JSON body are the same request.
        again = client.inference.chat(chat_request_from_dict(HELLO))
        chunks = list(
            client.inference.stream_chat({**HELLO, "stream_options": {"include_usage": True}})
        )

    [choice] = response.choices
    assert choice.message.content.string_value == fx.answer
    assert choice.finish_reason == "stop" and response.usage.completion_tokens > 0
    assert again.choices[0].message.content == choice.message.content

    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == fx.answer
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_closing_a_stream_early_cancels_it(pki: Any, replica: Any) -> None:
    with Client(inference=replica.address, security=pki.security()) as client:
        stream = client.inference.stream_chat(HELLO)
        first = next(stream)
        stream.close()
    assert first.choices[0].delta.role == "assistant"
    assert list(stream) == []


def test_embeddings_and_models(pki: Any, replica: Any) -> None:
    with Client(inference=replica.address, security=pki.security()) as client:
        response = client.inference.embed({"model": "embed-tiny", "input": ["hello", "world"]})
        models = client.inference.models()
        with pytest.raises(InvalidArgumentError) as wrong_task:
            client.inference.embed({"model": "kimi-tiny", "input": "hello"})
        with pytest.raises(NotFoundError) as unknown:
            client.inference.chat({**HELLO, "model": "nope"})
    assert [e.index for e in response.data] == [0, 1]
    assert len(response.data[0].embedding.list_value.values) == 16
    assert response.usage.prompt_tokens > 0
    assert sorted(m.id for m in models) == ["embed-tiny", "kimi-tiny"]
    assert (wrong_task.value.http_status, wrong_task.value.param) == (400, "model")
    assert (unknown.value.http_status, unknown.value.code) == (404, "model_not_found")


def test_only_the_replicas_callers_may_generate(pki: Any, replica: Any) -> None:
    with Client(inference=replica.address, security=pki.security(ROUTER)) as router:
        with pytest.raises(PermissionDeniedError):
            router.inference.chat(HELLO)
        with pytest.raises(PermissionDeniedError):
            router.inference.stream_chat(HELLO)  # raised before the first chunk: at the call
