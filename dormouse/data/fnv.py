"""FNV-1a 64-bit, and `doc_hash`: the one hash that routes documents (shards, eval tail).

Written by hand because it is a few lines and the routing must never change with a library upgrade.
FNV-1a xors the byte in *before* multiplying; plain FNV-1 multiplies first (a different hash).
"""

FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def fnv1a_64(data: bytes | str) -> int:
    if isinstance(data, str):
        data = data.encode("utf-8")
    h = FNV64_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV64_PRIME) & _MASK64
    return h


def mix64(h: int) -> int:
    """MurmurHash3's 64-bit finaliser (fmix64): a bijection of 64-bit ints whose every output bit depends on
    every input bit. FNV-1a alone moves its top bits little for a change in an id's last bytes, so ids that
    differ in a suffix ("doc-000200", "doc-000201") sort side by side, and the smallest hashes are runs of
    neighbouring ids, not a sample."""
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _MASK64
    return h ^ (h >> 33)


def doc_hash(doc_id: str) -> int:
    """The hash that routes a document by its id: mix64(fnv1a_64(id)). The eval tail is the smallest of
    them; a train document goes to shard doc_hash % num_shards."""
    return mix64(fnv1a_64(doc_id))
