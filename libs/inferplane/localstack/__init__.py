"""The local stack (`inferplane up`, and the end-to-end tests and benches): every service, the
node-agent, the fixture deployments and Envoy, run on this machine. See `_stack.py`'s docstring
for the start-up order and the data directory's layout, and docs/localstack.md for its use."""

from inferplane.localstack._stack import (
    EDGE_PROCESS,
    EMBED_MODEL_NAME,
    MODEL_NAME,
    NODE_NAME,
    SPEECH_MODEL_NAME,
    Stack,
    StackConfig,
    StackError,
    StackHost,
    embed_tiny_deployment,
    kimi_tiny_deployment,
    running_stack,
    service_of,
    whisper_tiny_deployment,
)

__all__ = [
    "EDGE_PROCESS",
    "EMBED_MODEL_NAME",
    "MODEL_NAME",
    "NODE_NAME",
    "SPEECH_MODEL_NAME",
    "Stack",
    "StackConfig",
    "StackError",
    "StackHost",
    "embed_tiny_deployment",
    "kimi_tiny_deployment",
    "running_stack",
    "service_of",
    "whisper_tiny_deployment",
]
