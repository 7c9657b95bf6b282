"""Shard throughput vs reading the same bytes (`cat`, `zstd -dc`, python decompress), on one core.

    taskset -c 1 .venv/bin/python -m benchmarks.shard_bench [--reps 3] [--profile auto|always|never]

Input: the shard stage's real input, the part files (docs-*.jsonl.zst) of the tiny preset's filter
artifact (digest from `dormouse plan --preset tiny --stage shard`). "Same bytes" is stated for each
row: the compressed part files as they lie on disk (what `cat` reads), their decompressed JSON lines,
and the document text inside (UTF-8), which is what the shard stage writes to .bin files. Every
MB/s below is *text* MB (10^6 bytes of document text) per second, whatever the row read, so rows
compare by the same yardstick. The page cache is warmed once before any timing.

Rows (median of --reps, each after one untimed warm-up):
  cat parts       `cat docs-*.jsonl.zst > /dev/null`  (subprocess, spawn included)
  cat jsonl       `cat <decompressed copy> > /dev/null`  (the same lines uncompressed; copy made untimed)
  zstd -dc        `zstd -dc docs-*.jsonl.zst > /dev/null`
  py read         read the part files in 1 MiB blocks in-process (cat without a process spawn)
  py decompress   zstandard stream_reader over the parts, 1 MiB reads (as docs_io.read_parts opens them)
  py read_parts   dormouse.data.docs_io.read_parts: decompress + readline + json.loads (one pass)
  shard work      dormouse.data.shards.shard_documents, the stage's own work (pass 1: decode each document
                  once into scratch bytes, doc_hash(id); cutoff; pass 2: route from the scratch bytes,
                  write .bin/.ids.jsonl/.idx.npy) into a temp dir
  shard stage     `dormouse shard --job` end to end in a subprocess on a temp store (the filter artifact
                  symlinked in): imports, sha256 verification of the whole input artifact (its 83 MB
                  quality_model.bin included), both passes, sha256 of the outputs and the manifest
The goal ratio is shard work / cat parts >= 0.5. When it is below (--profile auto), the shard work is
run once more under cProfile and the time is grouped by what it does.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import cProfile
import datetime
import hashlib
import io
import json
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import zstandard

from benchmarks.bench_env import (ROOT, TSV, append_tsv, cpu_model, git_rev, mem_gib, package_versions, plan_job,
                                  rerun_command)
from dormouse.data.docs_io import read_parts  # noqa: E402
from dormouse.data.fnv import fnv1a_64  # noqa: E402
from dormouse.data.shards import shard_documents  # noqa: E402

MB = 1_000_000


def versions() -> dict:
    return package_versions(("numpy", "pyarrow", "fasttext", "zstandard"))


def zstd_cli_version() -> str | None:
    import re

    if not shutil.which("zstd"):
        return None
    m = re.search(r"v(\d+\.\d+\.\d+)", subprocess.run(["zstd", "--version"], capture_output=True, text=True).stdout)
    return m.group(1) if m else "?"


# ------------------------------------------------------------------------------------- the shard work

class _Dir:
    """Stands in for the ArtifactWriter: shard_documents uses path(name), counters and extra."""

    def __init__(self, root: Path):
        self.root = root
        self.counters: Counter = Counter()
        self.extra: dict = {}

    def path(self, name: str) -> Path:
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p


def shard_work(parts: list[Path], n_shards: int, eval_target: int, out: Path, part_pattern: str | None) -> dict:
    """dormouse.data.shards.shard_documents itself (both passes), writing under `out`."""
    t0 = time.perf_counter()
    art = _Dir(out)
    shard_documents(parts, n_shards, eval_target, art, part_pattern)
    return {"total_s": time.perf_counter() - t0, "counters": dict(art.counters),
            "cutoff": art.extra["shards"]["eval_cutoff_hash"]}


# ------------------------------------------------------------------------------------------ baselines

def t_cmd(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def t_py_read(paths) -> float:
    t = time.perf_counter()
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass
    return time.perf_counter() - t


def t_py_decompress(paths) -> float:
    t = time.perf_counter()
    for p in paths:
        with open(p, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as r:
            while r.read(1 << 20):
                pass
    return time.perf_counter() - t


def t_read_parts(paths) -> float:
    t = time.perf_counter()
    for _ in read_parts(paths):
        pass
    return time.perf_counter() - t


def median_of(fn, reps: int) -> tuple[float, list[float]]:
    fn()  # warm-up, untimed
    xs = [fn() for _ in range(reps)]
    return statistics.median(xs), xs


# ------------------------------------------------------------------------------------------- profile

CATEGORIES = [  # (short label, label, predicate on (file, function name)); first match wins. Builtins have file "~".
    ("fnv1a_64", "fnv1a_64: pure-python byte loop over the ids", lambda f, n: n == "fnv1a_64"),
    ("json.loads", "json.loads (both passes; incl. bytes->str decode, detect_encoding, whitespace regex)",
     lambda f, n: ("json" in f and n in ("loads", "decode", "raw_decode", "detect_encoding"))
     or n in ("<method 'decode' of 'bytes' objects>", "<method 'match' of 're.Pattern' objects>",
              "<method 'startswith' of 'bytes' objects>")),
    ("zstd decompress+readline", "zstd decompress + line splitting (both passes; C calls of read_parts' for-loop over "
     "io.BufferedReader(zstd stream_reader) are charged to the generator)",
     lambda f, n: n == "read_parts" or "zstd" in n.lower() or "Decompress" in n),
    ("blake2b", "blake2b content key (pass 1, every document)", lambda f, n: n == "content_key" or "blake2b" in n),
    ("str.encode", "str.encode utf-8 (both passes)", lambda f, n: n == "<method 'encode' of 'str' objects>"),
    ("writes", "file writes (.bin, .ids.jsonl)", lambda f, n: n.startswith("<method 'write' of '_io.")),
    ("json.dumps ids", "json.dumps of ids (pass 2)", lambda f, n: "json" in f and n in ("dumps", "encode", "iterencode")),
    ("ShardWriter.write", "ShardWriter.write own code (offsets list)", lambda f, n: n == "write" and f.endswith("shards.py")),
    ("loop bodies", "loop bodies (counters, numpy scalar indexing, seen-id set)", lambda f, n: n == "shard_work"),
    ("numpy/close", "np.save / closes / numpy", lambda f, n: "numpy" in f or "close" in n or n == "save"),
]


def profile_shard(parts, n_shards, eval_target, part_pattern, tmp: Path, top: int = 25) -> tuple[list, list, float]:
    out = tmp / "profile-out"
    pr = cProfile.Profile()
    pr.enable()
    shard_work(parts, n_shards, eval_target, out, part_pattern)
    pr.disable()
    shutil.rmtree(out, ignore_errors=True)
    st = pstats.Stats(pr)
    rows = []
    for (f, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append((tt, ct, nc, f, line, name))
    total = sum(r[0] for r in rows)
    rows.sort(reverse=True)
    cats: dict[tuple, float] = defaultdict(float)
    for tt, _ct, _nc, f, _line, name in rows:
        label = ("other", "other")
        for short, lab, pred in CATEGORIES:
            if pred(f, name):
                label = (short, lab)
                break
        if label[0] == "other" and f == "~":
            label = ("other", f"other: {name}")
        cats[label] += tt
    cat_rows = sorted(((v, k) for k, v in cats.items()), reverse=True)
    return rows[:top], cat_rows, total


def micro_alternatives(parts) -> list[str]:
    """Measure the cheap alternatives the suggestions name, on the same documents (no dormouse change)."""
    docs = list(read_parts(parts))
    ids = [d["id"] for d in docs]
    texts = [d["text"] for d in docs]
    lines = []
    for p in parts:
        with open(p, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as r:
            lines.extend(io.BufferedReader(r, buffer_size=1 << 20))
    out = []

    def tm(fn, n=3):
        best = float("inf")
        for _ in range(n):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    out.append(f"fnv1a_64 over {len(ids)} ids ({sum(len(i.encode()) for i in ids)} bytes): "
               f"{tm(lambda: [fnv1a_64(i) for i in ids]) * 1e3:.1f} ms")
    out.append(f"json.loads over {len(lines)} lines ({sum(map(len, lines)) / MB:.1f} MB): {tm(lambda: [json.loads(x) for x in lines]) * 1e3:.1f} ms")
    try:
        import orjson  # noqa: F401

        out.append(f"orjson.loads, same lines: {tm(lambda: [orjson.loads(x) for x in lines]) * 1e3:.1f} ms")
    except ImportError:
        out.append("orjson not installed in this venv (not measured)")
    enc = [t.encode("utf-8") for t in texts]
    out.append(f"str.encode utf-8 of all texts: {tm(lambda: [t.encode('utf-8') for t in texts]) * 1e3:.1f} ms")
    out.append(f"blake2b(digest_size=16) of all texts: {tm(lambda: [hashlib.blake2b(b, digest_size=16).digest() for b in enc]) * 1e3:.1f} ms")
    out.append(f"sha1 of all texts (hashlib, for scale): {tm(lambda: [hashlib.sha1(b).digest() for b in enc]) * 1e3:.1f} ms")
    return out


# ---------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="directory for the shard outputs (default: system temp)")
    ap.add_argument("--profile", choices=["auto", "always", "never"], default="auto")
    ap.add_argument("--no-stage", action="store_true", help="skip the end-to-end `dormouse shard` subprocess rows")
    ap.add_argument("--no-tsv", action="store_true")
    args = ap.parse_args()

    aff = sorted(os.sched_getaffinity(0))
    command = ((f"taskset -c {','.join(map(str, aff))} " if len(aff) < (os.cpu_count() or 1) else "")
               + rerun_command("benchmarks.shard_bench", python=sys.executable))
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = f"{cpu_model()}; {os.cpu_count()} cores; {mem_gib():.0f} GiB; affinity {','.join(map(str, aff))}"
    v = versions()
    vers = (f"py {v['python']} numpy {v['numpy']} pyarrow {v['pyarrow']} fasttext {v['fasttext']} zstandard {v['zstandard']} "
            f"zstd-cli {zstd_cli_version()} "
            f"dormouse {git_rev()}")

    job = plan_job("shard", args.preset)
    n_shards, eval_target = job["params"]["num_shards"], job["params"]["eval_tail_bytes"]
    part_pattern = job["params"]["part_pattern"]
    fdig = job["inputs"]["filter"]["digest"]
    fdir = ROOT / "results/store/filter" / fdig
    parts = sorted(fdir.glob("docs-*.jsonl.zst"))
    if not parts:
        raise SystemExit(f"no docs-*.jsonl.zst in {fdir}; run the {args.preset} preset's filter first")

    # sizes: compressed, decompressed lines, text
    zst_bytes = sum(p.stat().st_size for p in parts)
    jsonl_bytes = text_bytes = docs = 0
    for p in parts:
        with open(p, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as r:
            for line in io.BufferedReader(r, buffer_size=1 << 20):
                jsonl_bytes += len(line)
                docs += 1
                text_bytes += len(json.loads(line)["text"].encode("utf-8"))
    text_mb = text_bytes / MB

    print(f"date: {date}")
    print(f"command: {command}")
    print(f"python {v['python']}  numpy {v['numpy']}  pyarrow {v['pyarrow']}  fasttext {v['fasttext']}  "
          f"zstandard {v['zstandard']}  {platform.platform()}  dormouse git {git_rev()}")
    print(f"cpu: {cpu_model()}  cores: {os.cpu_count()}  mem: {mem_gib():.1f} GiB  affinity: {aff}  "
          f"loadavg: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"input: {len(parts)} part file(s) of filter/{fdig}: {zst_bytes / MB:.3f} MB zst -> {jsonl_bytes / MB:.3f} MB "
          f"jsonl -> {docs} docs, {text_mb:.3f} MB text (UTF-8)   params: num_shards {n_shards}, eval_tail_bytes {eval_target}")
    print(f"reps: {args.reps} (median, after one warm-up each)", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="shard-bench-", dir=args.tmp))
    results: dict[str, dict] = {}
    try:
        plain = tmp / "parts-decompressed.jsonl"
        with open(plain, "wb") as f:
            for p in parts:
                with open(p, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as r:
                    shutil.copyfileobj(r, f, 1 << 20)
        t_py_read([*parts, plain])  # page cache

        spec = [
            ("cat parts", f"cat docs-*.jsonl.zst > /dev/null ({zst_bytes / MB:.2f} MB read)",
             lambda: t_cmd(["cat", *map(str, parts)])),
            ("cat jsonl", f"cat of the decompressed lines > /dev/null ({jsonl_bytes / MB:.2f} MB read)",
             lambda: t_cmd(["cat", str(plain)])),
            ("zstd -dc", "zstd -dc docs-*.jsonl.zst > /dev/null", lambda: t_cmd(["zstd", "-q", "-dc", *map(str, parts)])),
            ("py read", "python: read the part files in 1 MiB blocks", lambda: t_py_read(parts)),
            ("py decompress", "python zstandard stream_reader, 1 MiB reads", lambda: t_py_decompress(parts)),
            ("py read_parts", "dormouse read_parts: decompress + readline + json.loads", lambda: t_read_parts(parts)),
        ]
        for name, desc, fn in spec:
            med, xs = median_of(fn, args.reps)
            results[name] = {"s": med, "xs": xs, "desc": desc}

        runs = []

        def one_shard():
            out = tmp / "out"
            shutil.rmtree(out, ignore_errors=True)
            r = shard_work(parts, n_shards, eval_target, out, part_pattern)
            runs.append(r)
            return r["total_s"]

        med, xs = median_of(one_shard, args.reps)
        results["shard work"] = {"s": med, "xs": xs, "desc": "shard_documents (the stage's own two passes) into a temp dir"}
        counters = runs[-1]["counters"]

        # same answer as the real artifact?
        sdir = ROOT / "results/store/shard" / job["digest"]
        check = ""
        if (sdir / "manifest.json").exists():
            real = json.loads((sdir / "manifest.json").read_text())["counters"]
            same = all(real.get(k) == counters.get(k) for k in counters)
            check = f"counters {'match' if same else 'DIFFER from'} results/store/shard/{job['digest']}/manifest.json"

        if not args.no_stage:
            store = tmp / "store"
            (store / "filter").mkdir(parents=True)
            (store / "filter" / fdig).symlink_to(fdir)
            sjob = dict(job, out=str(store / "shard" / job["digest"]))
            (tmp / "job.json").write_text(json.dumps(sjob))
            env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}")

            def one_stage():
                shutil.rmtree(store / "shard", ignore_errors=True)
                t = time.perf_counter()
                subprocess.run(["dormouse", "shard", "--job", f"@{tmp / 'job.json'}"], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, check=True)
                return time.perf_counter() - t

            med, xs = median_of(one_stage, args.reps)
            results["shard stage"] = {"s": med, "xs": xs, "desc": "dormouse shard --job (subprocess, temp store)"}
            t = time.perf_counter()
            for p in sorted(fdir.iterdir()):
                if p.is_file():
                    hashlib.sha256(p.read_bytes()).hexdigest()
            results["  input sha256"] = {"s": time.perf_counter() - t, "xs": [],
                                         "desc": "of which: sha256 of every filter artifact file (open_artifact verify)"}

        print()
        print(f"{'row':<16} {'median s':>9} {'text MB/s':>10} {'shard/row':>10}   reps; what")
        shard_s = results["shard work"]["s"]
        for name, r in results.items():
            mbps = text_mb / r["s"] if r["s"] else float("inf")
            rel = (r["s"] / shard_s) if not name.startswith("  ") else None  # shard MB/s / row MB/s = row s / shard s
            print(f"{name:<16} {r['s']:9.4f} {mbps:10.1f} {'' if rel is None else f'{rel:9.1%}':>10}   "
                  f"{', '.join(f'{x:.4f}' for x in r['xs'])}; {r['desc']}")
        shard_mbps = text_mb / shard_s
        cat_mbps = text_mb / results["cat parts"]["s"]
        ratio = shard_mbps / cat_mbps
        print(f"\nshard work {shard_mbps:.1f} text MB/s vs cat parts {cat_mbps:.1f} text MB/s: ratio shard/cat = "
              f"{ratio:.2%} (goal >= 50%: {'met' if ratio >= 0.5 else 'NOT met'})")
        print(f"shard/py read_parts (the stage decodes the parts once, then routes from raw bytes): "
              f"{results['py read_parts']['s'] / shard_s:.1%}")
        print(f"counters: {json.dumps(counters, sort_keys=True)}  {check}", flush=True)

        prof_lines, micro = [], []
        if args.profile == "always" or (args.profile == "auto" and ratio < 0.5):
            top, cats, total = profile_shard(parts, n_shards, eval_target, part_pattern, tmp)
            print(f"\ncProfile of the shard work (one run; {total:.3f} s of tottime under the profiler):")
            print("  by kind of work:")
            for secs, (short, label) in cats:
                if secs / total >= 0.005:
                    print(f"    {secs / total:6.1%}  {secs:7.3f} s  {label}")
                    prof_lines.append(f"{short} {secs / total:.0%}")
            print("  top functions by own time:")
            for tt, _ct, nc, f, line, name in top[:15]:
                loc = f if f == "~" else f"{Path(f).name}:{line}"
                print(f"    {tt / total:6.1%}  {tt:7.3f} s  ncalls {nc:>8}  {loc} {name}")
            micro = micro_alternatives(parts)
            print("  micro-measurements on the same documents (best of 3):")
            for m in micro:
                print(f"    {m}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if args.no_tsv:
        return
    base = {"date": date, "machine": machine, "versions": vers, "command": command}
    note = (f"input filter/{fdig} {len(parts)} part(s): {zst_bytes / MB:.2f} MB zst, {jsonl_bytes / MB:.2f} MB jsonl, "
            f"{docs} docs, {text_mb:.2f} MB text; MB/s = text MB / s for every row; median of {args.reps}")
    note += f"; shard work s per rep {[round(x, 3) for x in results['shard work']['xs']]}"
    rows = [
        {**base, "metric": "shard_work_textMBps_vs_cat_parts", "value": f"{shard_mbps:.2f}", "baseline": f"{cat_mbps:.2f}",
         "ratio": f"{ratio:.4f}", "note": f"goal ratio >= 0.5; baseline = cat docs-*.jsonl.zst > /dev/null (subprocess); "
                                           f"shard = both passes of shard.main, writes to temp dir; {note}; {check}"
                                           + (f"; profile: {', '.join(prof_lines[:6])}" if prof_lines else "")},
    ]
    for name, metric in (("cat jsonl", "cat_jsonl"), ("zstd -dc", "zstd_dc"), ("py read", "py_read"),
                         ("py decompress", "py_zstd_decompress"), ("py read_parts", "py_read_parts")):
        b = text_mb / results[name]["s"]
        rows.append({**base, "metric": f"shard_work_textMBps_vs_{metric}", "value": f"{shard_mbps:.2f}",
                     "baseline": f"{b:.2f}", "ratio": f"{shard_mbps / b:.4f}",
                     "note": f"baseline = {results[name]['desc']}, s per rep {[round(x, 4) for x in results[name]['xs']]}; {note}"})
    if "shard stage" in results:
        st = text_mb / results["shard stage"]["s"]
        rows.append({**base, "metric": "shard_stage_end_to_end_textMBps_vs_cat_parts", "value": f"{st:.2f}",
                     "baseline": f"{cat_mbps:.2f}", "ratio": f"{st / cat_mbps:.4f}",
                     "note": f"dormouse shard --job subprocess on a temp store: imports + sha256 verify of the input artifact "
                             f"(every file, the 83 MB quality_model.bin included: {results['  input sha256']['s']:.2f} s of sha256 by itself) "
                             f"+ both passes + output sha256/manifest; per rep {[round(x, 3) for x in results['shard stage']['xs']]}; {note}"})
    append_tsv(rows)
    print(f"appended {len(rows)} rows to {TSV.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
