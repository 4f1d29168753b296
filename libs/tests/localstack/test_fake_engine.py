"""`StackConfig.fake_engine_token_delay`: the node-agent's engine command becomes the fake vLLM
HTTP engine at that token delay (as the node-agent's own settings loader reads the flag, and
as the fake engine reads the launcher's command line), only on the `http-completions`
transport; 0 leaves vLLM."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from inferplane.localstack import StackConfig, StackError
from inferplane.localstack._launch import _fake_engine_args
from inferplane.node_agent.settings import NodeAgentSettings
from inferplane.runtime import load_settings
from inferplane.testing import fake_http_engine


def test_the_node_agent_runs_the_fake_engine_at_the_token_delay(tmp_path: Path) -> None:
    config = StackConfig(
        data_dir=tmp_path, transport="http-completions", fake_engine_token_delay=0.05
    )
    settings = load_settings(
        NodeAgentSettings,
        service="node_agent",
        environ={},
        argv=["--plaintext", *_fake_engine_args(config)],
    )
    command = settings.engine_command
    assert command[:3] == (sys.executable, "-m", "inferplane.testing.fake_http_engine")
    # The launcher appends vLLM's command line; the fake keeps the delay and the port.
    opts = fake_http_engine.parse(
        [*command[3:], "--", "serve", "/models/kimi-tiny", "--host", "127.0.0.1",
         "--port", "8123", "--max-num-seqs", "4"]
    )  # fmt: skip
    assert (opts.token_delay, opts.port, opts.grpc) == (0.05, 8123, False)


def test_vllm_unless_asked_and_only_on_http_completions(tmp_path: Path) -> None:
    config = StackConfig(data_dir=tmp_path, transport="http-completions")
    assert _fake_engine_args(config) == []
    for transport in ("inproc", "grpc"):
        with pytest.raises(StackError, match="needs transport 'http-completions'"):
            _fake_engine_args(
                dataclasses.replace(config, transport=transport, fake_engine_token_delay=0.1)
            )
