"""Constants for the Qwen3-format fixture chat model ``qwen3-tiny``: where it lives, the
deployment that serves it, and a tools conversation to render with it.

``models/build_qwen3_tiny.py`` builds the folder: a random-initialised ``Qwen3ForCausalLM``
(hidden 64, 2 layers, head size 32, fp32) with a local byte-level BPE tokenizer holding Qwen3's
markers as single tokens and Qwen3's chat template (``enable_thinking``, ``<tool_call>`` JSON
calls). It is untrained: it writes random tokens, so tests check routing, rendering, parsing and
the stream contract, never the text.

Importing this module loads no ML library.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any

from inferplane.api.orchestrator.v1 import orchestrator_pb2
from inferplane.testing._fixtures import fixture_model_path

ENV_VAR = "INFERPLANE_QWEN3_TINY"
"""Environment variable that overrides the model directory."""

SERVED_MODEL_NAME = "qwen3-tiny"

PARSER = "qwen3"
"""The deployment's reasoning and tool parser (``inferplane.parsers``); it also selects Qwen3
chat rendering (``inferplane.chat.chat_family``)."""

MAX_POSITIONS = 2048
"""The model's position limit (config.json ``max_position_embeddings``)."""

MAX_MODEL_LEN = 1024
"""The deployment's context length in tokens (prompt + completion): a rendered tools prompt
is a few hundred tokens."""

MARKERS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
"""Qwen3's added tokens, each one token of the fixture's vocabulary (ids from the vocab)."""

SAMPLE_TEXTS: tuple[str, ...] = (
    "hello world",
    "What is the weather in Paris today?",
    'Unicode too: café, 東京, emoji 🙂 and JSON {"a": [1, 2.5, null]}\n',
)
"""Texts the build checks encode and decode back unchanged."""


def model_path() -> Path:
    """The fixture model directory: ``$INFERPLANE_QWEN3_TINY`` if set, else the repo's copy.

    Raises:
        FileNotFoundError: the directory has no ``config.json``; the message names the
            variable to set.
    """
    return fixture_model_path(SERVED_MODEL_NAME, ENV_VAR)


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": [*properties]},
        },
    }


TOOLS: tuple[dict[str, Any], ...] = (
    _function(
        "get_weather",
        "Current weather for a city.",
        {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
    ),
    _function("get_time", "Local time in a city.", {"city": {"type": "string"}}),
)
"""Two OpenAI function tools (fresh copies come from :func:`tools_request`)."""


def tools_request() -> dict[str, Any]:
    """An OpenAI chat request in a tool loop: system and user turns, an assistant call with a
    client-style id (``call_w1``) and compact string arguments, the tool's result, and
    :data:`TOOLS`; the model's turn comes next. A fresh copy on every call."""
    request: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "messages": [
            {"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_w1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city":"Paris","unit":"celsius"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_w1", "content": "18 celsius"},
        ],
        "tools": list(TOOLS),
    }
    return copy.deepcopy(request)


def deployment(transport: str = "inproc") -> orchestrator_pb2.Deployment:
    """The qwen3-tiny deployment: one CPU replica (`engine: vllm-cpu`, fp32), the ``qwen3``
    reasoning and tool parsers, :data:`MAX_MODEL_LEN` tokens, 4 concurrent sequences,
    `transport` (``inproc``, ``http-completions`` or ``grpc``).

    ``constrain_tool_choice_auto`` is on, as for every deployment by default: the tool-call
    structural tag is written in Qwen3's own ``<tool_call>`` format (the ``qwen3`` parser's
    ``call_syntax``; ``inferplane.parsers.build_tool_constraint``). Sizing numbers come from the
    folder's ``config.json`` and ``MANIFEST.json``.

    Raises:
        FileNotFoundError: the model folder is missing (see :func:`model_path`).
    """
    model = model_path()
    arch = json.loads((model / "config.json").read_text())
    manifest: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        manifest = json.loads((model / "MANIFEST.json").read_text())
    return orchestrator_pb2.Deployment(
        replicas=1,
        owned_by="inferplane",
        profile=orchestrator_pb2.DeploymentProfile(
            model_source=str(model),
            engine="vllm-cpu",
            precision="fp32",
            parameter_count=int(manifest.get("parameters") or 0) or 1,
            num_layers=int(arch["num_hidden_layers"]),
            num_kv_heads=int(arch["num_key_value_heads"]),
            head_dim=int(arch["head_dim"]),
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=4,
            reasoning_parser=PARSER,
            tool_parser=PARSER,
            transport=transport,
            constrain_tool_choice_auto=True,
        ),
    )
