"""The paged KV cache's bookkeeping: which physical blocks each request holds.

Units: blocks of `block_size` tokens. The scheduler owns this state; workers own the tensors.

Invariants:
* every block is either free (ref count 0, in the free list) or used (ref count >= 1);
  num_free_blocks + num_used_blocks == num_blocks at every moment.
* a running request holds blocks covering every token computed or scheduled:
  len(block_table) * block_size >= num_computed_tokens. The whole sequence is allocated at
  admission; a newly sampled token gets its slot (one block more when it crosses a block
  boundary) when its decode is scheduled.
* with prefix caching, a used block may be shared (ref count > 1) only if it is full and keyed.

The free list is ordered for reuse: blocks without a key are handed out first, then keyed
(cached) blocks oldest-freed first (LRU), so a freed prefix stays findable as long as possible.
"""
from __future__ import annotations

from collections import OrderedDict

from scheduler_svc.prefix_cache import PrefixCache, extend_block_hashes
from scheduler_svc.request import Request
from shared.config import cdiv


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0,
                 enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks  # kept free at admission so decodes can grow
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.events = None  # a scheduler_svc.kv_events.KVEventRecorder: cache changes as KV events

    # -- counts (blocks) -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- admission: the whole sequence so far ---------------------------------------------------
    def can_allocate(self, req: Request, shared: list[int] | None = None) -> bool:
        """Enough free blocks for all of req's tokens, keeping the watermark free.
        shared: used, computed blocks of req's leading tokens held by another request (a
        sibling with the same prompt): req takes a reference to them instead of new blocks."""
        hits = self._prefix_blocks(req, shared)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # hits still in the free list
        need = self.blocks_for(req.num_tokens) - len(hits) + revived
        return len(self._free) - need >= self.watermark_blocks

    def allocate(self, req: Request, shared: list[int] | None = None) -> int:
        """Give req blocks for all its tokens, reusing its cached prefix (or `shared`, see
        can_allocate); returns the number of prefix tokens found cached (already computed:
        num_computed_tokens starts there)."""
        assert not req.block_table, f"{req.req_id} already holds blocks"
        hits = self._prefix_blocks(req, shared)
        for b in hits:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1
        fresh = [self._take_free() for _ in range(self.blocks_for(req.num_tokens) - len(hits))]
        req.block_table = hits + fresh
        req.num_cached_blocks = len(hits)
        req.num_computed_tokens = len(hits) * self.block_size
        return req.num_computed_tokens

    # -- growth: one block as a decode crosses a block boundary -------------------------------
    def can_append(self, req: Request) -> bool:
        return self._missing_blocks(req) <= len(self._free)

    def append(self, req: Request) -> None:
        for _ in range(self._missing_blocks(req)):
            req.block_table.append(self._take_free())

    # -- speculative decoding: room for draft tokens, and its rollback ------------------------
    def extend_for_drafts(self, req: Request, num_drafts: int) -> int:
        """Blocks for up to num_drafts draft positions after req's tokens, taken only while the
        watermark stays free (drafts never preempt anyone nor use the decodes' reserve);
        returns how many drafts the blocks now cover (<= num_drafts)."""
        bs, table = self.block_size, req.block_table
        room = len(table) * bs - len(req.token_ids)
        while room < num_drafts and len(self._free) > self.watermark_blocks:
            table.append(self._take_free())
            room += bs
        return max(0, min(num_drafts, room))

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Free req's blocks past the first blocks_for(num_tokens) (the slots of rejected
        drafts). Those blocks hold no computed token of req, so none is shared or keyed."""
        keep = self.blocks_for(num_tokens)
        while len(req.block_table) > keep:
            b = req.block_table.pop()
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None
                self._free.move_to_end(b, last=False)

    def _missing_blocks(self, req: Request) -> int:
        # inlined arithmetic: called for every decode of every iteration
        # the slot of the token to compute next: the last known one, or for a decode planned
        # ahead (async scheduling) the one still to come
        need = max(len(req.token_ids), req.num_computed_tokens + 1)
        return max(0, cdiv(need, self.block_size) - len(req.block_table))

    # -- release --------------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Drop req's references. Tail blocks go back first so they are evicted before the
        prefix blocks that other requests are more likely to share."""
        for b in reversed(req.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None
                if self.cache is None or not self.cache.is_cached(b):
                    self._free.move_to_end(b, last=False)  # no content worth keeping
        req.block_table = []
        req.num_cached_blocks = 0

    # -- prefix caching -----------------------------------------------------------------------
    def cache_computed_blocks(self, req: Request, upto: int | None = None) -> None:
        """Key req's full blocks whose K/V are now computed (call after their batch ran): those
        of its first `upto` tokens (default num_computed_tokens; a batch planned ahead may have
        advanced that past the batch that ran, or past the known tokens)."""
        if self.cache is None:
            return
        done = req.num_computed_tokens if upto is None else min(upto, req.num_computed_tokens)
        num_full = min(done, len(req.token_ids)) // self.block_size
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, num_full)
        stored = [i for i in range(req.num_cached_blocks, num_full)
                  if self.cache.insert(req.block_hashes[i], req.block_table[i])]
        if self.events is not None:
            self.events.stored(req, stored)
        req.num_cached_blocks = max(req.num_cached_blocks, num_full)

    def forget_cached_contents(self) -> None:
        """The worker lost its KV tensors (it restarted): no block may be found by its key
        again. Blocks still held are freed later as uncached (to the front of the free list)."""
        if self.cache is not None:
            self.cache = PrefixCache()
            if self.events is not None:
                self.events.cleared()

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens of req's prefix found in this cache now (full blocks; 0 without caching)."""
        return len(self._cached_prefix(req)) * self.block_size

    def _prefix_blocks(self, req: Request, shared: list[int] | None) -> list[int]:
        """The longer of req's cached prefix and the blocks a sibling shares with it."""
        hits = self._cached_prefix(req)
        return list(shared) if shared and len(shared) > len(hits) else hits

    def _cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks of req's longest keyed prefix. At least the last token is left out,
        so there is always something to compute and a token to sample."""
        if self.cache is None:
            return []
        num_full = (req.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, num_full)
        hits = []
        for key in hashes[:num_full]:
            block = self.cache.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        if self.cache is not None:
            key = self.cache.evict(block)
            if key is not None and self.events is not None:
                self.events.removed(key)
        self.ref_counts[block] = 1
        return block
