"""The replica's inference pipeline: render → tokenize → generate → detokenize → parse →
validate → OpenAI chunks (the server, `inferplane.replica.server`, serves it as
`inferplane.inference.v1.InferenceService`)."""

from inferplane.replica.pipeline.assets import ModelAssets, ModelAssetsCache, load_model_assets

__all__ = [
    "ModelAssets",
    "ModelAssetsCache",
    "load_model_assets",
]
