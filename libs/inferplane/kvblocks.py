"""KV blocks by content: the one hash the replicas and the routers agree on (issue 29).

vLLM names its KV blocks by hashes seeded per process (unless `PYTHONHASHSEED` is fixed), so
two replicas name one prefix differently and a router cannot recompute them. The replica
therefore translates the engine's KV events (vLLM's `BlockStored` carries each block's token
ids) into *content hashes*, and the router hashes a request's prompt token ids the same way:
equal hashes mean an equal prefix up to and including that block, under the same adapter.

`chain(token_ids, block_size, adapter, parent)` hashes the full blocks of `token_ids` in order,
each over (the previous block's hash, the adapter name, the block's token ids as little-endian
uint32), with BLAKE2b-64, as vLLM chains its own block hashes. A partial last block is not
hashed (an engine caches full blocks only). Pure, no state, no I/O.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT: int = 0
"""The parent hash of a prompt's first block."""


def chain(
    token_ids: Sequence[int],
    block_size: int,
    adapter: str = "",
    parent: int = ROOT,
    max_blocks: int | None = None,
) -> list[int]:
    """Content hashes of the full `block_size`-token blocks of `token_ids`, in order.

    Args:
        token_ids: the prompt's token ids (or a run of blocks continuing `parent`).
        block_size: tokens per KV block (> 0), the engine's.
        adapter: the LoRA adapter's catalogue name, "" for the base model.
        parent: the hash of the block before `token_ids[0]` (`ROOT` at a prompt's start).
        max_blocks: hash at most this many blocks (None: all full blocks).

    Returns:
        One unsigned 64-bit hash per full block.

    Raises:
        ValueError: `block_size` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    salt = adapter.encode()
    out: list[int] = []
    fmt = f"<{block_size}I"
    for i in range(full):
        h = hashlib.blake2b(digest_size=8)
        h.update(parent.to_bytes(8, "little"))
        h.update(salt)
        h.update(b"\x00")
        h.update(struct.pack(fmt, *token_ids[i * block_size : (i + 1) * block_size]))
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


def blocks_needed(tokens: int, block_size: int) -> int:
    """KV blocks a sequence of `tokens` tokens occupies (ceil), 0 for none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return -(-max(tokens, 0) // block_size)
