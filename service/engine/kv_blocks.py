"""KV memory in fixed-size blocks, and automatic prefix caching over them (vLLM's block pool and
KV cache manager, vllm/v1/core). No tensors here: block ids and reference counts only; the runner's
PagedKVCache (model/kv_cache.py) holds the keys and values the ids index.

A sequence's block table lists the blocks holding its tokens in order: token t lives in block
table[t // block_size] at offset t % block_size. A full block is identified by a hash chained
over its tokens and every token before it (and a salt: the model, anything else that changes the
keys), so two sequences share a block exactly when their prefixes up to its end are equal.
Blocks nobody holds stay cached (their hash still maps to them) until a new block is needed:
then the least recently freed is evicted. Block 0 is never handed out: a null block that
fixed-shape steps point their padding at.
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

NULL_BLOCK = 0


def block_hashes(tokens: list[int], block_size: int, salt: str, start: list[bytes] | None = None) -> list[bytes]:
    """The chained hashes of every full block of tokens; start: hashes already known for the
    first blocks (extended, not recomputed). sha256 of (parent, the block's tokens, salt)."""
    hashes = list(start or [])
    parent = hashes[-1] if hashes else salt.encode()
    for begin in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        digest = hashlib.sha256(parent)
        digest.update(b",".join(str(t).encode() for t in tokens[begin : begin + block_size]))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up and found in the cache (vLLM's prefix_cache_queries and _hits)."""

    queries: int = 0
    hits: int = 0


@dataclass
class SequenceBlocks:
    """What the manager keeps for one sequence: its block table and its full blocks' hashes."""

    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order (computed as it grows)
    cached: int = 0  # how many of table's first blocks are registered in the cache


class KVBlockManager:
    """A pool of num_blocks blocks of block_size tokens (block 0 reserved), handed to sequences by
    id. Invariants (tests/engine/test_paged.py): a block is free or held (ref_count > 0), never
    both; the blocks of a finished sequence go back at once; a hash maps to one block whose tokens
    are exactly the prefix it hashes."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, salt: str = "") -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("a KV pool needs at least 2 blocks (one is the null block) of at least 1 token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching, self.salt = prefix_caching, salt
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.block_of_hash: dict[bytes, int] = {}
        # Free blocks, least recently freed first: a freed block goes to the back; allocation takes
        # from the front (evicting a cached block's hash), or from the back without prefix caching.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.sequences: dict[str, SequenceBlocks] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by sequences (cached free blocks count as free)."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        return self.sequences[seq_id].table

    def cached_prefix(self, seq_id: str, tokens: list[int]) -> int:
        """Takes, for a sequence holding no blocks, the cached blocks of the longest cached prefix
        of tokens (at most len(tokens) - 1 tokens: the last one is computed for its logits) and
        returns how many tokens they hold. (The scheduler counts admitted lookups in stats.)"""
        assert seq_id not in self.sequences or not self.sequences[seq_id].table, "a sequence looks its prefix up before it holds blocks"
        seq = self.sequences.setdefault(seq_id, SequenceBlocks())
        if not self.prefix_caching:
            return 0
        seq.hashes = block_hashes(tokens, self.block_size, self.salt)
        usable = (len(tokens) - 1) // self.block_size
        for digest in seq.hashes[:usable]:
            block = self.block_of_hash.get(digest)
            if block is None:
                break
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
            seq.table.append(block)
        seq.cached = len(seq.table)
        return len(seq.table) * self.block_size

    def allocate(self, seq_id: str, total_tokens: int) -> bool:
        """Grows the sequence's table to hold total_tokens; False (and nothing taken) when too few
        blocks are free."""
        seq = self.sequences.setdefault(seq_id, SequenceBlocks())
        needed = self.blocks_for(total_tokens) - len(seq.table)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            block = self._take_free()
            self.ref_count[block] = 1
            seq.table.append(block)
        return True

    def fills_new_blocks(self, seq_id: str, computed: int) -> bool:
        """Whether `computed` tokens fill a block of the sequence not yet registered (cache_blocks has work)."""
        return self.prefix_caching and computed // self.block_size > self.sequences[seq_id].cached

    def cache_blocks(self, seq_id: str, tokens: list[int], computed: int) -> None:
        """Registers the sequence's blocks that `computed` of tokens fill (computed, or being
        computed this step: a step writes every key before any sequence reads one)."""
        if not self.prefix_caching:
            return
        seq = self.sequences[seq_id]
        full = computed // self.block_size
        if full <= seq.cached:
            return
        if len(seq.hashes) < full:
            seq.hashes = block_hashes(tokens[: full * self.block_size], self.block_size, self.salt, seq.hashes)
        for index in range(seq.cached, full):
            block, digest = seq.table[index], seq.hashes[index]
            if digest not in self.block_of_hash and self.hash_of[block] is None:
                self.block_of_hash[digest] = block
                self.hash_of[block] = digest
        seq.cached = full

    def release(self, seq_id: str) -> None:
        """Returns every block of the sequence (finished, aborted or preempted); cached ones stay
        findable until evicted, the tail first (the least likely to be shared)."""
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return
        for block in reversed(seq.table):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, "block released twice"
            if self.ref_count[block] == 0:
                self.free[block] = None

    def fork(self, pairs: list[tuple[str, str]], tokens: int) -> list[tuple[int, int]]:
        """Beam search's reordering: each (parent, child) child's table becomes its parent's first
        `tokens` tokens, the full blocks shared (never written again: sequences only append) and
        the last partial block its own: the parent's itself where the parent's row takes another
        beam (so no longer writes it; its first child takes it), else a new one; returns the
        (parent's block, new block) pairs whose contents the caller copies. Every parent is read
        before any child's old blocks go back, so a row may be one pair's parent and another's
        child. Needs a free block per pair."""
        full, partial = divmod(tokens, self.block_size)
        # Rows that take another beam (their old blocks go back) whose last block has not yet moved to a child.
        movable = {child for _, child in pairs}
        tables, copies = {}, []
        for parent, child in pairs:
            source = self.sequences[parent].table
            table = source[:full]
            for block in table:
                self.ref_count[block] += 1
            if partial and parent in movable:  # the last block moves, uncopied (a partial block has one owner)
                movable.discard(parent)  # to its first child only
                assert self.ref_count[source[full]] == 1, "a partial block shared"
                self.ref_count[source[full]] += 1  # released with the parent's old table below
                table.append(source[full])
            elif partial:
                block = self._take_free()
                self.ref_count[block] = 1
                table.append(block)
                copies.append((source[full], block))
            tables[child] = table
        for child, table in tables.items():
            self.release(child)
            self.sequences[child] = SequenceBlocks(table)
        return copies

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (after a failed step, whose blocks may hold half-written keys)."""
        self.block_of_hash.clear()
        self.hash_of = [None] * self.num_blocks
        for seq in self.sequences.values():
            seq.cached = len(seq.table)  # never registered again: their keys may be the failed step's

    def _take_free(self) -> int:
        """A free block, its cached hash (if any) evicted: with prefix caching the least recently
        freed (a cached prefix lives longest), without it the most recently freed (its memory the
        likeliest to be in the CPU's caches still, where cycling through the pool finds it cold)."""
        block, _ = self.free.popitem(last=not self.prefix_caching)
        self._evict(block)
        return block

    def _evict(self, block: int) -> None:
        digest = self.hash_of[block]
        if digest is not None:
            del self.block_of_hash[digest]
            self.hash_of[block] = None
