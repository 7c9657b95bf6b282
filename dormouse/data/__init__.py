"""The data layer: raw readers, document heuristics and the quality classifier, hashing and shards, the byte stream, the n-gram anchors, and the pinned corpora."""
