"""The pool of KV-cache blocks: reference counts, a free queue and the prefix-cache map.

Pure Python, no torch: a block here is only an id into the runner's KV tensors.

A block whose reference count drops to zero goes to the back of the free queue but
keeps its content hash, so a later request with the same prefix can take it back
(prefix caching). Allocation takes from the front, evicting the least recently freed
cached block first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class KVBlock:
    """One block of `block_size` token slots in every layer's KV tensors."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix map

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Fixed set of blocks with ref counts, an LRU free queue and hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: front = evicted first. OrderedDict gives O(1)
        # removal from the middle when a cached free block is taken back.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (cached-but-unreferenced blocks count: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        """The block holding this content, if cached."""
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n free blocks (ref count 1), evicting cached content as needed."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                # Evicted: its content is about to be overwritten.
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to (cached) blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in eviction order (first freed, first evicted)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full block's content hash so other requests can share it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            # Another request computed the same content concurrently; keep the first.
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Withdraw a block's hash (its content was never computed)."""
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash of unreferenced blocks; returns how many were dropped."""
        dropped = 0
        for h, block in list(self._cached.items()):
            if block.ref_cnt == 0:
                del self._cached[h]
                block.block_hash = None
                dropped += 1
        return dropped
