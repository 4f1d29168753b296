"""What speculative decoding adds to a replica's memory (issue 30; `sizing.estimate` adds it).

- **ngram**: nothing. Proposals are looked up in the request's own tokens on the host.
- **eagle / eagle3**: a draft model on the same devices, loaded in the target's activation
  dtype (vLLM builds the draft's model config with the target's dtype; a quantized target's
  draft stays unquantized: 16 bit). Its parameters are counted exactly from the draft folder's
  safetensors headers when `speculative_model` is a local folder the orchestrator can read
  (`draft_shape`); otherwise estimated as twice one decoder layer of the target
  (`parameter_count / num_layers × 2`): an EAGLE head is one decoder layer plus a fusion
  layer of about the same size, and EAGLE-3's own small LM head (Li et al. 2024, "EAGLE",
  arXiv:2401.15077; Li et al. 2025, "EAGLE-3", arXiv:2503.01840). For Llama-3.1-8B that is
  0.5 B parameters, 1 GB at bf16.
- **mtp**: the model's own multi-token-prediction layers, part of its checkpoint, so already in
  `parameter_count` when that is the checkpoint's total (DeepSeek-V3's 685 B includes them).

Draft layers keep their own KV cache in the same pool (vLLM allocates a KV block table for every
attention layer, draft layers included), so KV bytes per token grow by the draft's layers: the
folder's `num_hidden_layers` when local, else 1 (EAGLE heads and MTP modules have one), at the
target's KV geometry and dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import struct
from pathlib import Path

from inferplane.engine_features import DRAFT_MODEL_METHODS

#: The largest safetensors header read (JSON of names, dtypes, shapes); real ones are KiB-MiB.
MAX_HEADER_BYTES = 64 * 2**20
#: Draft layers assumed when the draft's config cannot be read (EAGLE heads, MTP modules).
DEFAULT_DRAFT_LAYERS = 1
#: An estimated draft is this many decoder layers' share of the target's parameters.
ESTIMATED_DRAFT_LAYER_SHARES = 2


@dataclasses.dataclass(frozen=True, slots=True)
class DraftShape:
    """A draft model's size: parameters, attention layers with a KV cache, and whether both
    were read from its folder (`measured`) or estimated."""

    parameter_count: int
    layers: int
    measured: bool


def draft_shape(
    method: str, model: str, target_parameters: int, target_layers: int
) -> DraftShape | None:
    """The draft a profile's speculative decoding adds, or None (off, or ngram).

    `method`/`model`: the profile's `speculative_method`/`speculative_model`; the target's
    `parameter_count` and `num_layers` size the estimate. mtp adds layers (KV) but no
    parameters (module docstring).
    """
    if not method or method == "ngram":
        return None
    if method not in DRAFT_MODEL_METHODS:  # mtp: in the target's checkpoint
        return DraftShape(0, DEFAULT_DRAFT_LAYERS, measured=False)
    measured = _read_folder(model) if model else None
    if measured is not None:
        return measured
    share = math.ceil(target_parameters / max(1, target_layers))
    return DraftShape(share * ESTIMATED_DRAFT_LAYER_SHARES, DEFAULT_DRAFT_LAYERS, measured=False)


@functools.lru_cache(maxsize=256)
def _read_folder(model: str) -> DraftShape | None:
    """Parameters from the folder's `*.safetensors` headers and layers from its config.json;
    None when it is not a local folder with weights (a hub id, unreadable, another format).
    Cached per path: placement sizes every deployment on every plan."""
    folder = Path(model)
    try:
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            return None
        parameters = sum(_safetensors_parameters(f) for f in files)
        config = folder / "config.json"
        layers = DEFAULT_DRAFT_LAYERS
        if config.is_file():
            value = json.loads(config.read_text()).get("num_hidden_layers")
            if isinstance(value, int) and value > 0:
                layers = value
    except (OSError, ValueError):
        return None
    return DraftShape(parameters, layers, measured=True)


def _safetensors_parameters(path: Path) -> int:
    """Elements of every tensor in a safetensors file (its header: an 8-byte little-endian
    length, then JSON mapping names to dtype/shape/offsets).

    Raises:
        ValueError: not a safetensors header.
    """
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: no safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {size} bytes")
        header = json.loads(f.read(size))
    return sum(
        math.prod(entry.get("shape", ()))
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict)
    )
