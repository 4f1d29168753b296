"""LoRA adapters: the rules the catalogue, the node-agent and the replica share (issue 29).

An adapter is a folder in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``)
served on top of a base deployment whose replicas run vLLM with LoRA on (``--enable-lora``,
``--max-loras``, ``--max-lora-rank``: `inferplane.replica_contract.lora_args` writes them from
the spec's ``max_loras`` / ``max_lora_rank``). Defined once here:

- vLLM's allowed ranks (`ALLOWED_RANKS`, vLLM 0.32 ``vllm/config/lora.py`` ``MaxLoRARanks``
  less 1) and the most adapters a replica may hold (`MAX_LORAS`);
- `adapter_rank`: an adapter folder's rank as vLLM reads it (``r``, or the largest of
  ``rank_pattern``);
- `source_under_root`: an adapter source resolved (symlinks, ``..``) and required to lie under
  the allow-listed root;
- the error codes a replica refuses an adapter with (`REFUSALS`, OpenAI's ``code``).

Pure Python: nothing here imports vLLM or torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final

ALLOWED_RANKS: Final[tuple[int, ...]] = (8, 16, 32, 64, 128, 256, 320, 512)
"""Ranks a profile's `max_lora_rank` and an adapter may have: vLLM 0.32's ``MaxLoRARanks``
(``vllm/config/lora.py``: 1, 8, 16, ..., 512) without 1, which no PEFT recipe uses."""

DEFAULT_MAX_LORA_RANK: Final = 16
"""`max_lora_rank` when a spec turns LoRA on without one: vLLM's own default."""

MAX_LORAS: Final = 8
"""The most adapters one replica may hold at once (`max_loras` is 1..8): each slot reserves
the LoRA weights of `max_lora_rank` for every target module of the model."""

CONFIG_FILE: Final = "adapter_config.json"
"""PEFT's adapter configuration file (rank, alpha, target modules)."""

# --- refusals (OpenAI `code`, FAILED_PRECONDITION / HTTP 400, `param` "model") ----------------
LORA_DISABLED: Final = "lora_disabled"
"""The request names an adapter and the replica runs without LoRA (`max_loras` 0), or serves
another task than text generation."""
ADAPTER_SOURCE_NOT_ALLOWED: Final = "adapter_source_not_allowed"
"""The adapter's source is not under the replica's allow-listed root (`lora_root`), or the
replica has no root."""
ADAPTER_UNREADABLE: Final = "adapter_unreadable"
"""The adapter's folder has no readable PEFT ``adapter_config.json`` with a positive rank."""
ADAPTER_RANK_TOO_LARGE: Final = "adapter_rank_too_large"
"""The adapter's rank is above the replica's `max_lora_rank`."""
ADAPTER_TRANSPORT_UNSUPPORTED: Final = "adapter_transport_unsupported"
"""The replica's engine transport cannot serve adapters (`grpc`)."""
INVALID_ADAPTER: Final = "invalid_adapter"
"""The adapter headers are malformed (a name without a source, a name vLLM cannot take)."""

REFUSALS: Final[tuple[str, ...]] = (
    LORA_DISABLED,
    ADAPTER_SOURCE_NOT_ALLOWED,
    ADAPTER_UNREADABLE,
    ADAPTER_RANK_TOO_LARGE,
    ADAPTER_TRANSPORT_UNSUPPORTED,
    INVALID_ADAPTER,
)


class AdapterError(ValueError):
    """An adapter refused; `code` is one of `REFUSALS`."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def source_under_root(source: str, root: str) -> Path:
    """`source` resolved (symlinks followed, ``..`` collapsed, relative to the working
    directory) when it lies under `root` (resolved the same way) or is `root` itself.

    Raises:
        AdapterError: `ADAPTER_SOURCE_NOT_ALLOWED` when `root` is empty or `source` resolves
            outside it (a symlink that leaves the root counts as outside).
    """
    if not root:
        raise AdapterError(
            "this replica has no allow-listed adapter root (lora_root); it serves no adapter",
            ADAPTER_SOURCE_NOT_ALLOWED,
        )
    if not source:
        raise AdapterError("the adapter has no source folder", ADAPTER_SOURCE_NOT_ALLOWED)
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(source))
    if real != real_root and real_root not in real.parents:
        raise AdapterError(
            f"adapter source {source!r} is outside the allow-listed adapter root",
            ADAPTER_SOURCE_NOT_ALLOWED,
        )
    return real


def adapter_rank(folder: Path) -> int:
    """The adapter's rank as vLLM checks it against `max_lora_rank`: the largest of
    ``r`` and the values of ``rank_pattern`` in ``adapter_config.json`` (vLLM 0.32
    ``PEFTHelper.validate_legal``).

    Raises:
        AdapterError: `ADAPTER_UNREADABLE`: no such file, not JSON, not a LoRA config, or no
            positive integer rank.
    """
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(
            f"the adapter folder has no readable {CONFIG_FILE} ({type(exc).__name__})",
            ADAPTER_UNREADABLE,
        ) from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{CONFIG_FILE} is not a LoRA adapter's", ADAPTER_UNREADABLE)
    pattern = config.get("rank_pattern") or {}
    ranks: list[int] = []
    for r in (config.get("r"), *(pattern.values() if isinstance(pattern, dict) else [None])):
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise AdapterError(f"{CONFIG_FILE} has no positive integer rank", ADAPTER_UNREADABLE)
        ranks.append(r)
    return max(ranks)
