"""FNV-1a 64-bit: the one hash that routes documents (shards, eval tail).

Written by hand because it is eight lines and the routing must never change with a library upgrade.
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
