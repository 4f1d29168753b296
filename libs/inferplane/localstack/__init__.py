"""The local stack: every service, the node-agent(s), the fixture deployments and Envoy, run on
this machine. `inferplane up` runs it; the end-to-end tests, the multi-host tests and the
benches start it. docs/localstack.md describes its use, its start-up order and its data
directory.

Modules (private; import from here):

- `_config`: process names, `StackHost`, `StackConfig`;
- `_deployments`: the fixture deployments (kimi-tiny, qwen3-tiny, embed-tiny, whisper-tiny);
- `_process`: `ManagedProcess` (one child process, stopped with its group), Envoy in a host;
- `_launch`: each process's command line, certificates, and the waits between starts;
- `_stack`: `Stack` (start-up order, stop, the deployments, queries) and `running_stack`;
- `_prometheus`: deploy/'s Prometheus configuration, pointed at a stack's ports;
- `netns` (public, imported as `inferplane.localstack.netns`): hosts made of Linux network
  namespaces, for the multi-host and regions tests and benches;
- `regions` (public, `inferplane.localstack.regions`): several regions, each a whole stack, and
  the global tier in front of them (docs/regions.md).
"""

from inferplane.localstack._config import (
    EDGE_PROCESS,
    EMBED_MODEL_NAME,
    MODEL_NAME,
    NODE_NAME,
    QWEN3_MODEL_NAME,
    SPEECH_MODEL_NAME,
    UP_SAMPLING_DEFAULTS,
    StackConfig,
    StackError,
    StackHost,
    service_of,
)
from inferplane.localstack._deployments import (
    embed_tiny_deployment,
    kimi_tiny_deployment,
    qwen3_tiny_deployment,
    whisper_tiny_deployment,
)
from inferplane.localstack._launch import benchmark_key_file
from inferplane.localstack._prometheus import engine_sd_file, render_prometheus_config
from inferplane.localstack._stack import Stack, running_stack

__all__ = [
    "EDGE_PROCESS",
    "EMBED_MODEL_NAME",
    "MODEL_NAME",
    "NODE_NAME",
    "QWEN3_MODEL_NAME",
    "SPEECH_MODEL_NAME",
    "UP_SAMPLING_DEFAULTS",
    "Stack",
    "StackConfig",
    "StackError",
    "StackHost",
    "benchmark_key_file",
    "embed_tiny_deployment",
    "engine_sd_file",
    "kimi_tiny_deployment",
    "qwen3_tiny_deployment",
    "render_prometheus_config",
    "running_stack",
    "service_of",
    "whisper_tiny_deployment",
]
