"""The chat deployments the local stack creates: both families (kimi-tiny and, with `qwen3`,
qwen3-tiny) at `StackConfig.max_model_len`, 131,072 tokens by default, never past the models'
position limit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from inferplane.fixtures import kimi_tiny, qwen3_tiny
from inferplane.localstack import (
    EMBED_MODEL_NAME,
    MODEL_NAME,
    QWEN3_MODEL_NAME,
    SPEECH_MODEL_NAME,
    Stack,
    StackConfig,
    StackError,
    kimi_tiny_deployment,
    qwen3_tiny_deployment,
)


def test_default_context_is_the_models_whole_limit(tmp_path: Path) -> None:
    config = StackConfig(data_dir=tmp_path)
    assert config.max_model_len == kimi_tiny.MAX_MODEL_LEN == kimi_tiny.MAX_POSITIONS == 131_072
    assert config.max_model_len <= qwen3_tiny.MAX_POSITIONS
    assert kimi_tiny_deployment(config).profile.max_model_len == 131_072
    qwen3 = qwen3_tiny_deployment(config)
    assert qwen3.profile.max_model_len == 131_072
    assert qwen3.profile.reasoning_parser == qwen3.profile.tool_parser == qwen3_tiny.PARSER


def test_one_field_sets_both_chat_deployments(tmp_path: Path) -> None:
    config = StackConfig(data_dir=tmp_path, max_model_len=4096)
    assert kimi_tiny_deployment(config).profile.max_model_len == 4096
    assert qwen3_tiny_deployment(config).profile.max_model_len == 4096


@pytest.mark.parametrize("max_model_len", [0, kimi_tiny.MAX_POSITIONS + 1])
def test_a_context_past_the_position_limit_is_refused(tmp_path: Path, max_model_len: int) -> None:
    config = StackConfig(data_dir=tmp_path, max_model_len=max_model_len)
    with pytest.raises(StackError, match="max_position_embeddings"):
        kimi_tiny_deployment(config)
    with pytest.raises(StackError, match="max_position_embeddings"):
        qwen3_tiny_deployment(config)


def test_qwen3_adds_the_second_chat_family(tmp_path: Path) -> None:
    """`inferplane up` serves all four fixtures; the default config (tests, benches) only
    kimi-tiny."""
    config = StackConfig(data_dir=tmp_path)
    assert list(Stack(config).deployments()) == [MODEL_NAME]
    every = dataclasses.replace(config, qwen3=True, embeddings=True, speech=True)
    assert list(Stack(every).deployments()) == [
        MODEL_NAME,
        QWEN3_MODEL_NAME,
        EMBED_MODEL_NAME,
        SPEECH_MODEL_NAME,
    ]
