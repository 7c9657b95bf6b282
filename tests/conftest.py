"""Shared fixtures: a small raw corpus made of real text that ships with every CPython.

- technical prose: the reference-manual topics in `pydoc_data.topics` (79 documents, ~465 KB);
- code: standard-library modules;
- low quality: the generated codec tables in `encodings/cp*.py` (hex tables, near-identical lines).
Written in the three raw formats the readers must handle.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path
from pydoc_data.topics import topics

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

STDLIB = Path(sysconfig.get_paths()["stdlib"])
REPO = Path(__file__).resolve().parent.parent
CODE_MODULES = ["textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "colorsys.py", "glob.py",
                "string.py", "queue.py", "sched.py", "calendar.py", "difflib.py", "csv.py", "tokenize.py"]


def real_docs() -> dict[str, list[tuple[str, str]]]:
    prose = sorted(topics.items())
    code = [(f"stdlib/{m}", (STDLIB / m).read_text()) for m in CODE_MODULES]
    lowq = [(f"stdlib/encodings/{p.name}", p.read_text()) for p in sorted((STDLIB / "encodings").glob("cp*.py"))]
    return {"prose": prose, "code": code, "lowq": lowq}


def write_jsonl_zst(path: Path, rows: list[dict]) -> None:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(data))


def write_nested_parquet(path: Path, rows: list[dict], row_group_size: int = 8) -> None:
    table = pa.table({
        "id": [r["id"] for r in rows],
        "document": pa.array([{"title": r["id"], "text": r["text"], "url": f"https://example.org/{r['id']}"} for r in rows]),
    })
    pq.write_table(table, path, row_group_size=row_group_size)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """Raw corpus dir: prose split over jsonl.zst and parquet, code as txt, low-quality in jsonl.zst and txt."""
    root = tmp_path_factory.mktemp("corpus")
    docs = real_docs()
    prose = [{"id": f"topic/{k}", "text": v, "source": "pydoc_topics", "metadata": {}} for k, v in docs["prose"]]
    write_jsonl_zst(root / "prose.jsonl.zst", prose[::2])
    write_nested_parquet(root / "prose.parquet", prose[1::2])
    (root / "code").mkdir()
    for name, text in docs["code"]:
        (root / "code" / Path(name).name.replace(".py", ".txt")).write_text(text)
    lowq = docs["lowq"]
    write_jsonl_zst(root / "lowq.jsonl.zst", [{"id": k, "text": v} for k, v in lowq[: len(lowq) // 2]])
    (root / "lowq").mkdir()
    for name, text in lowq[len(lowq) // 2 :]:
        (root / "lowq" / Path(name).name.replace(".py", ".txt")).write_text(text)
    return root


@pytest.fixture(scope="session")
def quality_examples(tmp_path_factory) -> tuple[Path, Path]:
    """Positive / negative example sets for the fastText classifier (real text, disjoint from small_corpus ids)."""
    root = tmp_path_factory.mktemp("quality")
    docs = real_docs()
    pos = [{"id": f"ex/{k}", "text": v} for k, v in docs["prose"][::3]]
    pos += [{"id": f"ex/{n}", "text": t} for n, t in docs["code"][::2]]
    neg = [{"id": f"ex/{n}", "text": t} for n, t in docs["lowq"][::2]]
    (root / "positive").mkdir()
    (root / "negative").mkdir()
    write_jsonl_zst(root / "positive" / "hq.jsonl.zst", pos)
    write_jsonl_zst(root / "negative" / "lq.jsonl.zst", neg)
    return root / "positive", root / "negative"


@pytest.fixture()
def workdir(tmp_path) -> Path:
    """A copy of the workflow (Snakefile, rules, config) to run Snakemake or plans in (schemas: the package's)."""
    for name in ("Snakefile", "profiles", "workflow", "config", "envs", "requirements.txt"):
        src = REPO / name
        if src.is_symlink():  # profiles -> workflow/profiles (Snakemake's default-profile lookup)
            (tmp_path / name).symlink_to(src.readlink())
        else:
            (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    (tmp_path / "corpus" / "demo").mkdir(parents=True)
    return tmp_path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops: a second intra-op thread only adds OpenMP hand-offs (and on a shared 2-core box, stalls)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Slow tests (kills, SLURM submissions, multi-process DDP, experiments under Snakemake) keep the
    default suite short; `make test-all` (DORMOUSE_SLOW_TESTS=1) runs them. Network tests (downloads, the
    package index) run with DORMOUSE_NETWORK_TESTS=1."""
    skips = {"slow": ("DORMOUSE_SLOW_TESTS", "slow; set DORMOUSE_SLOW_TESTS=1 (make test-all)"),
             "network": ("DORMOUSE_NETWORK_TESTS", "needs the package registries; set DORMOUSE_NETWORK_TESTS=1")}
    for marker, (env, reason) in skips.items():
        if os.environ.get(env):
            continue
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))
