"""Request-body keys the API does not know, through the whole stack (issue 19, item 4).

As with OpenAI, a key the platform would otherwise drop is a 400 naming it ("Unrecognized
request argument supplied: X", `param` X), at the top level and inside a message; the vLLM
extensions the API documents (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `chat_template_kwargs`, ...) pass and reach the engine; a well-formed request is
served as before. Every field of vLLM 0.32's request models passes the edge (issue 27,
docs/request-fields.md): the replica honours it, ignores it with a documented reason, or
refuses a value it cannot serve with a 400 naming the field (`unsupported_parameter`).
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from inferplane.fixtures import kimi_tiny
from inferplane.localstack import MODEL_NAME, Stack

pytestmark = pytest.mark.e2e

UNRECOGNIZED = "Unrecognized request argument supplied: "


def _post(stack: Stack, api_key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        stack.config.base_url.rstrip("/") + path,
        json=body,
        headers={"authorization": f"Bearer {api_key}"},
        timeout=120,
    )


def test_a_typo_is_a_bad_request_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"temprature": 0.2},
        )
    assert info.value.status_code == 400
    assert info.value.body == {
        "message": UNRECOGNIZED + "temprature",
        "type": "invalid_request_error",
        "param": "temprature",
        "code": None,
    }


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "weight": 2}], "stream": True},
            "messages[0].weight",
        ),
        # vLLM removed best_of (and guided_decoding_backend) before 0.32: nobody defines them.
        ("/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
        (
            "/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "guided_decoding_backend": "xgrammar",
            },
            "guided_decoding_backend",
        ),
    ],
)
def test_unknown_keys_in_messages_and_other_routes_are_400s(
    stack: Stack, api_key: str, path: str, body: dict[str, Any], param: str
) -> None:
    response = _post(stack, api_key, path, {"model": MODEL_NAME, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"] == UNRECOGNIZED + param


def test_documented_vllm_extensions_pass_and_well_formed_requests_are_unchanged(
    client: openai.OpenAI,
) -> None:
    """The same greedy request with and without sampling extensions that change nothing at
    temperature 0 gives the fixture model's known answer; `ignore_eos` with `min_tokens`
    makes it write past the end where it stopped before: the extensions reach the engine."""
    case = next(c for c in kimi_tiny.RELIABLE_CASES if not c.tool_calls and c.content)
    request = case.request()
    plain = client.chat.completions.create(
        model=MODEL_NAME,
        messages=request["messages"],
        temperature=0,
        extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
    )
    assert plain.choices[0].message.content == case.content
    extended = client.chat.completions.create(
        model=MODEL_NAME,
        messages=request["messages"],
        temperature=0,
        extra_body={
            "chat_template_kwargs": request["chat_template_kwargs"],
            "top_k": 1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
        },
    )
    assert extended.choices[0].message.content == case.content
    assert plain.choices[0].finish_reason == "stop" and plain.usage is not None
    longer = plain.usage.completion_tokens + 16
    forced = client.chat.completions.create(
        model=MODEL_NAME,
        messages=request["messages"],
        temperature=0,
        max_tokens=longer,
        extra_body={
            "chat_template_kwargs": request["chat_template_kwargs"],
            "ignore_eos": True,
            "min_tokens": longer,
        },
    )
    assert forced.usage is not None and forced.usage.completion_tokens == longer
    assert forced.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"priority": 3}, "priority"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ],
)
def test_a_vllm_field_the_platform_does_not_serve_is_a_400_naming_it(
    stack: Stack, api_key: str, body: dict[str, Any], param: str
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    response = _post(
        stack,
        api_key,
        "/chat/completions",
        {"model": MODEL_NAME, "max_tokens": 4, "messages": messages, **body},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert error["type"] == "invalid_request_error" and param in error["message"]


def test_vllm_fields_with_their_defaults_pass(client: openai.OpenAI) -> None:
    """A body built from vLLM's request model sends its defaults explicitly; they ask for
    nothing and are served (GuideLLM's stream_options included)."""
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "use_beam_search": False,
            "priority": 0,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "add_generation_prompt": True,
            "length_penalty": 1.0,
            "request_id": "client-chosen",
            "bad_words": [],
        },
    )
    chunks = list(stream)
    assert chunks and all(c.usage is not None for c in chunks)
