"""Multi-LoRA through the whole stack (issue 29): the fixture adapter `kimi-tiny-lora` is created
as a catalogue object on kimi-tiny through the orchestrator's API, and then, with the official
`openai` client through the edge at temperature 0:

- `kimi-tiny:<adapter>` (and its alias) answers with the adapter's trained reply, which
  differs from the base model's; the base model's answer is its canonical one before and after
  (the adapter changes nothing for requests without it);
- `/v1/models` lists the adapter's names, owned by the base's owner;
- an API key allowed only `kimi-tiny` gets 403 `model_not_allowed` for the adapter, and a key
  allowed only the adapter gets 403 for the base;
- the usage ledger's row of an adapter request names the adapter;
- deleting the adapter makes its names 404 `model_not_found` at once (the orchestrator drops
  its routes), while the base model keeps answering; its row goes once the routers report no
  request for the base, before the drain grace.

The module has its own stack (kimi-tiny with `max_loras` 2, `max_lora_rank` 8; listed in
conftest's OWN_STACK_MODULES), started before the session's: ~40 s in all on a quiet box (35 s
of it the stack's start, the adapter's first load 0.1 s), 155 s on the shared 2-core box under
other suites' load.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.fixtures import kimi_tiny, kimi_tiny_lora
from inferplane.localstack import MODEL_NAME, Stack
from inferplane.sdk import Client, NotFoundError

from .conftest import local_config

pytestmark = pytest.mark.e2e

ADAPTER = "ahoy"
ADAPTER_MODEL = f"{MODEL_NAME}:{ADAPTER}"
ALIAS = "kimi-tiny-ahoy"
CASE = kimi_tiny.NO_TOOL  # among the adapter's training prompts: its reply is known


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = local_config(
        tmp_path_factory.mktemp("lora"), max_loras=2, max_lora_rank=kimi_tiny_lora.RANK
    )
    stack = Stack(config)
    started = time.monotonic()
    stack.start(print)
    print(f"LoRA stack ready in {time.monotonic() - started:.0f} s")
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def operator(lora_stack: Stack) -> Iterator[Client]:
    """The SDK as the stack's operator (the orchestrator's admin identity)."""
    with Client(
        orchestrator=lora_stack.config.address("orchestrator"),
        security=lora_stack.config.security,
        timeout=30,
    ) as client:
        yield client


def _client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.config.base_url, api_key=key, max_retries=0, timeout=180)


def _answer(client: openai.OpenAI, model: str) -> Any:
    request = CASE.request()
    return client.chat.completions.create(
        model=model,
        messages=request["messages"],
        tools=request["tools"],
        temperature=0,
        max_tokens=48,
        extra_body={"chat_template_kwargs": request["chat_template_kwargs"]},
    )


def _until(check: Any, what: str, seconds: float = 30.0) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _admin(stack: Stack) -> dict[str, str]:
    return {"authorization": f"Bearer {stack.admin_key}"}


def _key(stack: Stack) -> tuple[str, str]:
    """A new inference key through the admin API: (secret, key id)."""
    body = {"tenant": "lora-e2e", "scopes": ["inference"]}
    answer = httpx.post(
        f"{stack.config.base_url}/admin/api-keys", json=body, headers=_admin(stack), timeout=30
    )
    assert answer.status_code == 200, answer.text
    created = answer.json()
    return created["secret"], created["api_key"]["name"].removeprefix("api-keys/")


def test_an_adapter_answers_as_trained_and_leaves_the_base_unchanged(
    lora_stack: Stack, operator: Client
) -> None:
    stack = lora_stack
    key, key_id = _key(stack)
    client = _client(stack, key)
    base_before = _answer(client, MODEL_NAME).choices[0].message
    assert base_before.content == CASE.content

    created = operator.deployments.create_adapter(
        ADAPTER,
        orchestrator_pb2.LoraAdapter(
            base_deployment=MODEL_NAME,
            source=str(kimi_tiny_lora.adapter_path()),
            aliases=[ALIAS],
        ),
    )
    assert created.name == f"adapters/{ADAPTER}" and created.phase == "Ready"
    assert created.rank == kimi_tiny_lora.RANK
    _until(lambda: stack.serving_endpoints(ADAPTER_MODEL), "the adapter's route")

    listed = {m.id: m for m in client.models.list().data}
    assert {ADAPTER_MODEL, ALIAS} <= set(listed)
    assert listed[ADAPTER_MODEL].owned_by == listed[MODEL_NAME].owned_by

    started = time.monotonic()
    with_adapter = _answer(client, ADAPTER_MODEL)
    print(f"first adapter request (adapter load included): {time.monotonic() - started:.1f} s")
    message = with_adapter.choices[0].message
    assert message.content == kimi_tiny_lora.ADAPTER_CONTENT != base_before.content
    assert _answer(client, ALIAS).choices[0].message.content == kimi_tiny_lora.ADAPTER_CONTENT
    base_after = _answer(client, MODEL_NAME).choices[0].message
    assert (base_after.content, base_after.tool_calls) == (
        base_before.content,
        base_before.tool_calls,
    )

    # The ledger's row of the adapter request names the adapter; the base's names none.

    def rows() -> list[dict[str, Any]]:
        answer = httpx.get(
            f"{stack.config.base_url}/admin/usage",
            params={"key_id": key_id},
            headers=_admin(stack),
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        found = answer.json().get("rows", [])
        return found if len(found) >= 4 else []

    by_model: dict[str, set[str]] = {}
    for row in _until(rows, "4 ledger rows"):
        by_model.setdefault(row["model"], set()).add(row.get("adapter", ""))
    assert by_model == {MODEL_NAME: {""}, ADAPTER_MODEL: {ADAPTER}, ALIAS: {ADAPTER}}


def test_allow_lists_name_adapters_explicitly(lora_stack: Stack) -> None:
    stack = lora_stack
    _until(lambda: stack.serving_endpoints(ADAPTER_MODEL), "the adapter's route")
    base_only = _client(stack, stack.create_api_key("base-only", allowed_models=[MODEL_NAME]))
    with pytest.raises(openai.PermissionDeniedError) as refused:
        _answer(base_only, ADAPTER_MODEL)
    assert refused.value.code == "model_not_allowed"
    assert _answer(base_only, MODEL_NAME).choices[0].message.content == CASE.content
    adapter_only = _client(stack, stack.create_api_key("adapter-only", allowed_models=[ALIAS]))
    with pytest.raises(openai.PermissionDeniedError):
        _answer(adapter_only, MODEL_NAME)
    # A grant of the alias grants the adapter's canonical name too.
    content = _answer(adapter_only, ADAPTER_MODEL).choices[0].message.content
    assert content == kimi_tiny_lora.ADAPTER_CONTENT


def test_deleting_the_adapter_makes_it_unknown_and_keeps_the_base(
    lora_stack: Stack, operator: Client
) -> None:
    stack = lora_stack
    client = _client(stack, stack.create_api_key("e2e-lora-delete"))
    _until(lambda: stack.serving_endpoints(ADAPTER_MODEL), "the adapter's route")
    left = operator.deployments.delete_adapter(ADAPTER)
    assert left is not None and left.phase == "Deleting"  # the base's drain grace is 30 s

    def gone() -> bool:
        try:
            _answer(client, ADAPTER_MODEL)
        except openai.NotFoundError as exc:
            return exc.code == "model_not_found"
        return False

    _until(gone, "a 404 for the deleted adapter", seconds=15)
    with pytest.raises(openai.NotFoundError):
        _answer(client, ALIAS)
    assert _answer(client, MODEL_NAME).choices[0].message.content == CASE.content
    assert ADAPTER_MODEL not in {m.id for m in client.models.list().data}

    # No request uses it: the routers' next reports (every ~3 s) say the base is idle, and the
    # row goes before the 30 s drain grace.
    def row_gone() -> bool:
        try:
            operator.deployments.get_adapter(ADAPTER)
        except NotFoundError:
            return True
        return False

    started = time.monotonic()
    _until(row_gone, "the drained adapter's row to go", seconds=25)
    print(f"adapter row gone {time.monotonic() - started:.1f} s after the 404s")
