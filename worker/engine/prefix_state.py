"""What shared prefixes (``shared_prefix.py``, their only writer) keep: each prefix slot's chain of
blocks, and each sequence's link to the chains it reads and extends.

Apart from ``shared_prefix.py`` so that a sequence can hold its link without the sequence
module importing the code that moves prefixes around.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class PrefixSlot:
    slot: int  # the cache slot that holds it
    num_tokens: int = 0  # positions [0, num_tokens) hold a chain of full blocks
    hashes: list[int] = field(default_factory=list)  # the chain's block hashes
    num_refs: int = 0  # sequences attached to it
    num_kv_blocks: int = 0  # charged to the KV budget while referenced, to the idle budget while not
    last_used: int = 0


@dataclass(eq=False, slots=True)
class PrefixLink:
    """One sequence's place among the prefix slots."""

    # A prompt prefix it reads from a prefix slot instead of holding: its first ``shared_len``
    # tokens, which its own slot then does not hold.
    shared: PrefixSlot | None = None
    shared_len: int = 0
    # The chain its first ``chain_len`` tokens are cached in (read, copied from or published
    # to): where its later blocks are published, extending that chain in place.
    chain: PrefixSlot | None = None
    chain_len: int = 0
    chain_hash: int = 0  # the hash of its last block there: is the chain still its own?
    # Chained hashes of its first full blocks: its tokens only ever grow at the end (prompt,
    # then outputs), so a waiting prompt is hashed once, not at every step.
    block_hashes: list[int] = field(default_factory=list)
