"""Per-request block tables on top of the block pool: allocate_slots, free, prefix hits.

A request's tokens live in its blocks in order: token i sits in block i // block_size,
slot i % block_size. Full blocks are identified by a chained hash of their tokens
(sha256 of the parent block's hash and this block's token ids), so two requests with
the same prefix map it to the same blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from worker.engine.block_pool import BlockPool, KVBlock
from worker.request import Request

_ROOT_HASH = b"kvflow-prefix-root"


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Content hash of one full block, chained to the hash of the blocks before it."""
    return hashlib.sha256(parent + array("I", token_ids).tobytes()).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool and the block table of every running request."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks already published in the pool
        # Prefix-cache counters, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache --------------------------------------------------------------------

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes to cover the full blocks among its first num_tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        toks = req.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, toks[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Cached blocks holding the start of req's tokens, and how many tokens they cover.

        At least one token is always left to compute, so the step produces its logits.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, max_blocks * self.block_size)
        hits: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def count_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Record one admission's prefix lookup (for the hit-rate figure)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # -- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Make room for req's next num_new_tokens tokens (after any computed_blocks).

        Returns False, changing nothing, when the free blocks do not suffice: the caller
        then waits or preempts. computed_blocks are prefix-cache hits for a request that
        holds no blocks yet.
        """
        blocks = self._blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(computed_blocks)
        # Hits sitting in the free queue stop being allocatable once we take them.
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimed:
            if not blocks:
                del self._blocks[req.request_id]
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        if self.enable_caching:
            self._publish_full_blocks(req, blocks, total)
        return True

    def _publish_full_blocks(self, req: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # The tokens being computed this step are known, so their blocks can be published
        # now: any request that reuses them runs after this step has filled them.
        full = min(num_tokens, req.num_tokens) // self.block_size
        start = self._num_cached.get(req.request_id, 0)
        if full <= start:
            return
        self._update_hashes(req, full * self.block_size)
        for i in range(start, full):
            self.pool.cache(blocks[i], req.block_hashes[i])
        self._num_cached[req.request_id] = full

    def free(self, req: Request) -> None:
        """Release all of req's blocks; its tail is evicted first, its prefix kept longest."""
        blocks = self._blocks.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)
        if not blocks:
            return
        # A request preempted in the step that scheduled it published blocks whose
        # tokens were never computed: withdraw them before anyone can hit them.
        for block in blocks[req.num_computed_tokens // self.block_size :]:
            self.pool.uncache(block)
        self.pool.free(reversed(blocks))

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
