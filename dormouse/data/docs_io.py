"""Document part files inside artifacts: zstd JSON lines `{id, text, source, ...}`, rotated by size."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Callable, Iterator

import zstandard

PART_BYTES = 256 << 20  # uncompressed bytes per part file


class PartWriter:
    """Writes `<prefix>-00000.jsonl.zst`, `-00001`, ... through `path_for(name)` (an artifact's path())."""

    def __init__(self, path_for: Callable[[str], Path], prefix: str, level: int = 3):
        self._path_for, self._prefix, self._level = path_for, prefix, level
        self._n = 0
        self._f = None
        self._written = 0
        self.names: list[str] = []

    def _open(self):
        name = f"{self._prefix}-{self._n:05d}.jsonl.zst"
        self.names.append(name)
        self._raw = open(self._path_for(name), "wb")
        self._f = zstandard.ZstdCompressor(level=self._level).stream_writer(self._raw)
        self._written = 0
        self._n += 1

    def write(self, obj: dict) -> None:
        if self._f is None or self._written >= PART_BYTES:
            self.close()
            self._open()
        line = json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n"
        self._f.write(line)
        self._written += len(line)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()  # also closes the raw file and ends the frame
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_parts(paths: list[Path]) -> Iterator[dict]:
    for p in paths:
        with open(p, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as r:
            for line in io.BufferedReader(r, buffer_size=1 << 20):
                yield json.loads(line)
