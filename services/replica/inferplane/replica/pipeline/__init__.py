"""The replica's inference pipeline: render → tokenize → generate → detokenize → parse →
validate → OpenAI chunks, served as `inferplane.inference.v1.InferenceService`."""

from inferplane.replica.pipeline.assets import ModelAssets, ModelAssetsCache, load_model_assets
from inferplane.replica.pipeline.outcome import OutcomeSink, RequestOutcome, discard_outcome
from inferplane.replica.pipeline.servicer import REPLICA_METADATA_KEY, InferenceServicer

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
