"""Prefix caching: full KV blocks found again by a chained hash of their tokens.

A block's key is hash((key of the previous block, its block_size token ids)), so a key names the
whole prefix up to the block's end, not just its own tokens: two requests share block i only if
they agree on every token before it. Keys are Python hashes of int tuples, which are stable
across processes (hash randomisation only applies to str/bytes), so a key can also name a
block in the kvstore. Only *full* blocks are keyed; a partial last block is never shared, so a
shared block is never written again.
"""
from __future__ import annotations

ROOT_HASH = 0x5A7A_7A11  # the "previous block" of block 0


def chain_hash(parent: int, tokens: list[int]) -> int:
    """Key of a full block with `tokens` whose prefix before it has key `parent`."""
    return hash((parent, tuple(tokens)))


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int,
                        num_full_blocks: int) -> list[int]:
    """Grow `hashes` in place to the first `num_full_blocks` blocks of `token_ids`; returns it.

    Incremental: a request's hashes are computed once, as its tokens become known.
    """
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_full_blocks):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Two-way map key <-> physical block id for blocks whose K/V are computed.

    Invariant: a block has at most one key and a key at most one block. A block keeps its key
    while free (ref count 0) and loses it only when it is handed out for new content (evict).
    """

    def __init__(self) -> None:
        self._block_of: dict[int, int] = {}
        self._key_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, key: int) -> int | None:
        return self._block_of.get(key)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._key_of

    def insert(self, key: int, block_id: int) -> bool:
        """Register a computed block; False if the key is already held by another block
        (two requests computed the same prefix at once: the first one stays the shared copy)."""
        if key in self._block_of or block_id in self._key_of:
            return False
        self._block_of[key] = block_id
        self._key_of[block_id] = key
        return True

    def evict(self, block_id: int) -> int | None:
        """Forget a block that is about to be overwritten; returns the key it had (None: none)."""
        key = self._key_of.pop(block_id, None)
        if key is not None:
            del self._block_of[key]
        return key
