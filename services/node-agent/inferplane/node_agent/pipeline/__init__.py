"""The node-agent's inference pipeline: render → tokenize → generate → detokenize → parse →
validate → OpenAI chunks, served as `inferplane.inference.v1.InferenceService`."""

from inferplane.node_agent.pipeline.assets import ModelAssets, ModelAssetsCache, load_model_assets
from inferplane.node_agent.pipeline.outcome import OutcomeSink, RequestOutcome, discard_outcome
from inferplane.node_agent.pipeline.servicer import REPLICA_METADATA_KEY, InferenceServicer

__all__ = [
    "REPLICA_METADATA_KEY",
    "InferenceServicer",
    "ModelAssets",
    "ModelAssetsCache",
    "OutcomeSink",
    "RequestOutcome",
    "discard_outcome",
    "load_model_assets",
]
