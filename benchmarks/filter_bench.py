"""Filter throughput per core: dormouse's filter loop vs datatrove's equivalent pipeline, same input.

    taskset -c 1 .venv/bin/python -m benchmarks.filter_bench [--reps 3] [--dt-python /tmp/dtvenv/bin/python]

Input: the demo corpus's jsonl.zst files (corpus/demo/data/jsonl/*.jsonl.zst), read as they are by
both sides (datatrove's JsonlReader opens .zst through fsspec's "infer" compression, no decompressing
step needed). Model: quality_model.bin of the tiny preset's filter artifact (its digest comes from
`dormouse plan --preset tiny --stage filter`). Thresholds: the tiny preset's, with the schema defaults
filled in by the plan, nulls included.

Each side runs in its own subprocess pinned to one core (`taskset -c CPU`), one task, one thread:
  ours       .venv python; the same loop as dormouse.stages.filter.main (read_file -> min_doc_bytes ->
             heuristic_drop_reason -> prepare + fastText score in batches of SCORE_BATCH -> candidate
             part -> threshold -> final docs part), minus the artifact manifest and the tqdm bar.
  datatrove  a separate venv (datatrove 0.10.1); JsonlReader -> LambdaFilter(min_doc_bytes) ->
             LambdaFilter(our C4 doc rules) -> GopherRepetitionFilter -> GopherQualityFilter ->
             FastTextClassifierFilter -> JsonlWriter(zstd), steps chained as LocalPipelineExecutor
             chains them (generator per step), so the model and spaCy can be loaded before the clock.
"loop" time excludes imports and model load (reported separately); "process" time is the whole
subprocess wall clock, imports and model load included. MB = 10^6 bytes of document text (UTF-8)
read; MB/s per core = text MB / loop seconds on the one pinned core. Median of --reps runs.

Where datatrove's filters are not the same rules as ours (stated again in the TSV note column):
  * C4: ours drops a whole document on "lorem ipsum" or any line > max_line_bytes (2000) bytes, and
    the terminal-punctuation rule is null (off). datatrove's C4QualityFilter is a line *editor* (it
    strips every line, drops lines, rewrites doc.text) and has no "line longer than N bytes" rule
    (only "drop lines holding a word > N chars"), so the same semantics needs a LambdaFilter; we use
    one with exactly our two rules (--dt-c4 builtin instead runs C4QualityFilter with only
    lorem-ipsum on plus the long-line lambda, which also rewrites the text: for reference only).
  * Gopher words: datatrove tokenizes English with spaCy (punctuation tokens split off), ours splits on
    whitespace. --dt-words split hands datatrove's Gopher filters a WordTokenizer that does str.split,
    which isolates the framework + filter code from the tokenizer choice (a cProfile of one datatrove
    run on 2026-12-02 put ~85% of its time in spaCy's tokenizer). datatrove's stop-word rule counts
    *distinct* stop words, ours counts occurrences; its bullets are only "•" and "-"; its char
    fractions divide by len(text).
  * Gopher repetition: datatrove also has the duplicate 5..10-gram rules; ours has none, so they are
    turned off (dup_n_grams=()). Lines are split on "\n+" (ours: non-blank splitlines()).
  * fastText: both use P(__label__hq) >= threshold on the text with newlines replaced by one space
    (datatrove: newline_replacement=" "; ours: " ".join(splitlines())). Ours scores 512 docs per
    multilinePredict call (fasttext 0.9.3), datatrove predicts one doc at a time (k=-1) through
    fasttext-numpy2-wheel 0.9.2: the same C++ model code.
  * Output: ours writes a candidate part and then the final part (the stage's two passes, for the
    top_fraction mode); datatrove writes one JsonlWriter file. Both zstd level 3.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import datetime
import glob
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()
from benchmarks.bench_env import (ROOT, TSV, append_tsv, cpu_model, git_rev, mem_gib, package_versions, plan_job,
                                  rerun_command)

MB = 1_000_000


# ------------------------------------------------------------------------------------------ workers

def worker_ours(cfg: dict) -> dict:
    t0 = time.perf_counter()
    import shutil
    from collections import Counter, defaultdict

    from dormouse.data import quality
    from dormouse.data.readers import ReaderConfig
    from dormouse.data.filtering import filter_documents
    from dormouse.data.readers import iter_records

    t_import = time.perf_counter() - t0
    params = cfg["params"]
    qcfg = params["quality"]
    reader_cfg = ReaderConfig(**params["reader"])
    t = time.perf_counter()
    model = quality.load(Path(cfg["model"]))
    quality.check_labels(model, qcfg["label_hq"], "bench")
    t_model = time.perf_counter() - t

    tmp = Path(tempfile.mkdtemp(prefix="filter-bench-ours-"))
    scratch, out_dir = tmp / "scratch", tmp / "out"
    scratch.mkdir()
    out_dir.mkdir()
    try:
        t = time.perf_counter()
        # --- dormouse.data.filtering.filter_documents: the stage's own loop, minus manifest and tqdm ---
        c: Counter = Counter()
        per_file: dict[str, Counter] = defaultdict(Counter)
        records = iter_records(cfg["inputs"], reader_cfg, c, [])
        filter_documents(records, params, model, Path(cfg["model"]), c, lambda n: out_dir / n, per_file)
        t_loop = time.perf_counter() - t
        # --- end of the timed loop; count what was written, as for datatrove ---
        kept_docs, kept_bytes = count_output(sorted(out_dir.glob("docs-*.jsonl.zst")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    drops = {k.removeprefix("docs_dropped."): v for k, v in sorted(c.items()) if k.startswith("docs_dropped.")}
    return {
        "side": "ours", "import_s": t_import, "model_load_s": t_model, "loop_s": t_loop,
        "docs_read": c["docs_read"], "text_bytes_read": c["bytes_read"],
        "docs_kept": kept_docs, "text_bytes_kept": kept_bytes, "drops": drops,
        "versions": package_versions(["numpy", "pyarrow", "fasttext", "zstandard", "dormouse"]),
    }


def count_output(paths) -> tuple[int, int]:
    import zstandard

    n = b = 0
    for p in paths:
        with open(p, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as r:
            for line in io.BufferedReader(r, buffer_size=1 << 20):
                if line.strip():
                    n += 1
                    b += len(json.loads(line)["text"].encode("utf-8"))
    return n, b


def worker_datatrove(cfg: dict) -> dict:
    t0 = time.perf_counter()
    from collections import deque

    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FastTextClassifierFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
        LambdaFilter,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.text import split_into_words
    from datatrove.utils.word_tokenizers import WordTokenizer
    from loguru import logger

    t_import = time.perf_counter() - t0
    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # the INFO line per input file would be noise, not work

    class SplitTokenizer(WordTokenizer):
        """--dt-words split: our word definition (str.split) inside datatrove's Gopher filters."""

        def word_tokenize(self, text):
            return text.split()

        def sent_tokenize(self, text):  # not called by the Gopher filters
            raise NotImplementedError

        def span_tokenize(self, text):
            raise NotImplementedError

    lang = {"language": SplitTokenizer("split")} if cfg["dt_words"] == "split" else {}  # default: English = spaCy
    params = cfg["params"]
    h = params["heuristics"]
    qcfg = params["quality"]
    if qcfg["threshold"] is None:
        raise SystemExit("datatrove side: FastTextClassifierFilter has no top_fraction mode; the preset must set a threshold")
    min_bytes = params["min_doc_bytes"]
    steps = []
    # our ReaderConfig fields (text_field/id_field) -> JsonlReader keys
    reader = JsonlReader(cfg["input_dir"], glob_pattern="*.jsonl.zst", text_key=params["reader"]["text_field"],
                         id_key=params["reader"]["id_field"], compression="infer")
    steps.append(reader)
    steps.append(LambdaFilter(lambda doc: len(doc.text.encode("utf-8")) >= min_bytes))
    labels = {id(steps[-1]): "min_doc_bytes(lambda)"}
    c4 = h.get("c4")
    if c4 is not None:
        if c4.get("min_terminal_punct_lines_ratio") is not None:
            raise SystemExit("datatrove side: no document-level terminal-punctuation ratio rule in datatrove")
        lorem = c4.get("drop_lorem_ipsum", True)
        max_line = c4.get("max_line_bytes")
        if cfg["dt_c4"] == "builtin":
            steps.append(C4QualityFilter(split_paragraph=True, remove_citations=False, filter_no_terminal_punct=False,
                                         min_num_sentences=-1, min_words_per_line=-1, max_word_length=-1,
                                         filter_lorem_ipsum=lorem, filter_javascript=False,
                                         filter_curly_bracket=False, filter_policy=False))
            lorem = False
        if lorem or max_line is not None:
            def c4_rules(doc, lorem=lorem, max_line=max_line):
                text = doc.text
                if lorem and "lorem ipsum" in text.lower():
                    return False
                if max_line is not None and any(len(ln.encode("utf-8")) > max_line for ln in text.splitlines()):
                    return False
                return True
            steps.append(LambdaFilter(c4_rules))
            labels[id(steps[-1])] = "c4_doc_rules(lambda)"
    rep = h.get("gopher_repetition")
    if rep is not None:
        top = tuple((n, rep.get(f"max_top_{n}gram_char_frac")) for n in (2, 3, 4))
        steps.append(GopherRepetitionFilter(
            dup_line_frac=rep.get("max_dup_line_frac"), dup_para_frac=rep.get("max_dup_para_frac"),
            dup_line_char_frac=rep.get("max_dup_line_char_frac"), dup_para_char_frac=rep.get("max_dup_para_char_frac"),
            top_n_grams=tuple((n, f) for n, f in top if f is not None),
            dup_n_grams=(),  # ours has no duplicate 5..10-gram rules
            **lang,
        ))
    gq = h.get("gopher_quality")
    if gq is not None:
        steps.append(GopherQualityFilter(
            min_doc_words=gq.get("min_words"), max_doc_words=gq.get("max_words"),
            min_avg_word_length=gq.get("min_mean_word_length"), max_avg_word_length=gq.get("max_mean_word_length"),
            max_symbol_word_ratio=gq.get("max_symbol_word_ratio"),
            max_bullet_lines_ratio=gq.get("max_bullet_lines_ratio"),
            max_ellipsis_lines_ratio=gq.get("max_ellipsis_lines_ratio"),
            max_non_alpha_words_ratio=gq.get("max_non_alpha_words_ratio"),
            min_stop_words=gq.get("min_stop_words"),
            **lang,
        ))
    label = qcfg["label_hq"].removeprefix("__label__")
    ft = FastTextClassifierFilter(cfg["model"], keep_labels=[(label, qcfg["threshold"])], newline_replacement=" ")
    steps.append(ft)
    tmp = Path(tempfile.mkdtemp(prefix="filter-bench-dt-"))
    steps.append(JsonlWriter(str(tmp / "out"), compression="zstd"))

    t = time.perf_counter()
    _ = ft.model  # copies the local .bin into the HF assets cache once, then loads it
    t_model = time.perf_counter() - t
    t = time.perf_counter()
    split_into_words("Load the spaCy tokenizer before the clock starts.", **lang)
    t_spacy = time.perf_counter() - t
    import shutil

    try:
        t = time.perf_counter()
        data = None
        for step in steps:  # what executor.base._run_for_rank does, without logging/stats files
            data = step(data, 0, 1)
        deque(data, maxlen=0)
        t_loop = time.perf_counter() - t
        kept_docs, kept_bytes = count_output(sorted(glob.glob(str(tmp / "out" / "*.zst"))))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    drops, docs_read = {}, None
    for s in steps:
        d = s.stats.to_dict()["stats"]
        if s is reader:
            docs_read = _total(d.get("documents"))
        dropped = {k.removeprefix("dropped_"): _total(v) for k, v in d.items() if k.startswith("dropped")}
        if dropped:
            drops[labels.get(id(s), type(s).__name__)] = dropped
    return {
        "side": "datatrove", "import_s": t_import, "model_load_s": t_model + t_spacy, "loop_s": t_loop,
        "docs_read": docs_read, "docs_kept": kept_docs, "text_bytes_kept": kept_bytes, "drops": drops,
        "versions": package_versions(["datatrove", "numpy", "fasttext-numpy2-wheel", "spacy", "orjson", "zstandard", "fsspec"]),
    }


def _total(v):
    return v.get("total") if isinstance(v, dict) else v


# --------------------------------------------------------------------------------------------- main

def input_stats(files: list[Path]) -> dict:
    import zstandard

    docs = tbytes = jbytes = 0
    for p in files:
        with open(p, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as r:
            for line in io.BufferedReader(r, buffer_size=1 << 20):
                jbytes += len(line)
                if line.strip():
                    docs += 1
                    tbytes += len(json.loads(line)["text"].encode("utf-8"))
    return {"files": len(files), "zst_bytes": sum(p.stat().st_size for p in files), "jsonl_bytes": jbytes,
            "docs": docs, "text_bytes": tbytes}


def run_worker(side: str, python: str, cfg_path: Path, cpu: str) -> tuple[dict, float]:
    # cwd=ROOT: `-m benchmarks.filter_bench` finds the package there, also under the datatrove venv's python
    cmd = ["taskset", "-c", cpu, python, "-m", "benchmarks.filter_bench", "--worker", side, "--cfg", str(cfg_path)]
    env = dict(os.environ)
    if side == "datatrove":
        env.setdefault("HF_HOME", str(Path(tempfile.gettempdir()) / "filter-bench-hf"))  # where datatrove caches the model
        env["PYTHONPATH"] = ""  # never import our venv's packages
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{side} worker failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1]), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["ours", "datatrove"], help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--input-dir", default=str(ROOT / "corpus/demo/data/jsonl"))
    ap.add_argument("--model", help="fastText .bin (default: the planned filter artifact's quality_model.bin)")
    ap.add_argument("--dt-python", default="/tmp/dtvenv/bin/python", help="python of the datatrove venv")
    ap.add_argument("--dt-c4", choices=["lambda", "builtin"], default="lambda")
    ap.add_argument("--dt-words", choices=["spacy", "split"], default="spacy",
                    help="datatrove's word tokenizer for the Gopher filters: its English default (spaCy) or str.split "
                         "as ours (a WordTokenizer subclass passed as language=)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu", default="1", help="taskset -c list for each worker")
    ap.add_argument("--no-tsv", action="store_true")
    args = ap.parse_args()

    if args.worker:
        cfg = json.loads(Path(args.cfg).read_text())
        res = (worker_ours if args.worker == "ours" else worker_datatrove)(cfg)
        res["process_s_inside"] = time.perf_counter() - T_START
        print(json.dumps(res))
        return

    command = rerun_command("benchmarks.filter_bench", python=sys.executable)
    if os.sched_getaffinity(0) != set(range(os.cpu_count() or 1)):
        command = f"taskset -c {','.join(map(str, sorted(os.sched_getaffinity(0))))} {command}"
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = f"{cpu_model()}; {os.cpu_count()} cores; {mem_gib():.0f} GiB; worker cores {args.cpu}"
    job = plan_job("filter", args.preset)
    params = job["params"]
    model = args.model or str(ROOT / job["out"] / "quality_model.bin")
    if not Path(model).exists():
        found = sorted(glob.glob(str(ROOT / "results/store/filter/*/quality_model.bin")))
        if not found:
            raise SystemExit(f"no fastText model at {model}; run the tiny preset first or pass --model")
        model = found[0]
    files = sorted(Path(args.input_dir).glob("*.jsonl.zst"))
    if not files:
        raise SystemExit(f"no .jsonl.zst under {args.input_dir}")
    inp = input_stats(files)

    print(f"date: {date}")
    print(f"command: {command}")
    print(f"python {platform.python_version()}  {platform.platform()}  dormouse git {git_rev()}")
    print(f"cpu: {cpu_model()}  cores: {os.cpu_count()}  mem: {mem_gib():.1f} GiB  "
          f"parent affinity: {sorted(os.sched_getaffinity(0))}  workers: taskset -c {args.cpu}  "
          f"loadavg: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"input: {inp['files']} files {args.input_dir}/*.jsonl.zst, {inp['zst_bytes'] / MB:.2f} MB zst, "
          f"{inp['jsonl_bytes'] / MB:.2f} MB jsonl, {inp['docs']} docs, {inp['text_bytes'] / MB:.3f} MB text")
    print(f"model: {model} ({Path(model).stat().st_size / MB:.1f} MB)")
    print(f"params ({args.preset}): {json.dumps({k: params[k] for k in ('min_doc_bytes', 'heuristics')}, sort_keys=True)}")
    print(f"quality: label {params['quality']['label_hq']} threshold {params['quality']['threshold']} "
          f"top_fraction {params['quality']['top_fraction']}   datatrove C4 mode: {args.dt_c4}, words: {args.dt_words}",
          flush=True)

    with tempfile.TemporaryDirectory(prefix="filter-bench-") as tmp:
        cfg_path = Path(tmp) / "cfg.json"
        cfg_path.write_text(json.dumps({"params": params, "model": model, "inputs": [args.input_dir],
                                        "input_dir": args.input_dir, "dt_c4": args.dt_c4,
                                        "dt_words": args.dt_words}))
        sides = {"ours": str(ROOT / ".venv/bin/python")}
        dt_error = None
        if Path(args.dt_python).exists():
            sides["datatrove"] = args.dt_python
        else:
            dt_error = f"no datatrove venv at {args.dt_python}"
        results: dict[str, list] = {s: [] for s in sides}
        for rep in range(args.reps):
            for side, py in sides.items():  # interleaved, so drift in machine load hits both sides
                if side == "datatrove" and dt_error:
                    continue
                try:
                    res, wall = run_worker(side, py, cfg_path, args.cpu)
                except RuntimeError as e:
                    if side != "datatrove":
                        raise
                    dt_error = str(e).splitlines()[0] + " " + str(e).splitlines()[-1]
                    print(f"datatrove side failed: {e}", flush=True)
                    continue
                res["process_s"] = wall
                results[side].append(res)
                print(f"  rep {rep + 1} {side:<9} loop {res['loop_s']:7.2f} s  process {wall:7.2f} s  "
                      f"(imports {res['import_s']:.2f} s, model load {res['model_load_s']:.2f} s)  "
                      f"kept {res['docs_kept']} docs", flush=True)

    text_mb = inp["text_bytes"] / MB
    summary = {}
    for side, runs in results.items():
        if not runs:
            continue
        loop = statistics.median(r["loop_s"] for r in runs)
        proc = statistics.median(r["process_s"] for r in runs)
        last = runs[-1]
        summary[side] = {"loop_s": loop, "process_s": proc, "mbps": text_mb / loop, "mbps_process": text_mb / proc,
                         "res": last, "n": len(runs)}
    print()
    print(f"{'side':<10} {'loop s':>8} {'MB/s/core':>10} {'process s':>10} {'MB/s/core incl. load':>21} "
          f"{'docs read':>10} {'docs kept':>10} {'MB kept':>9}")
    for side, s in summary.items():
        r = s["res"]
        print(f"{side:<10} {s['loop_s']:8.2f} {s['mbps']:10.2f} {s['process_s']:10.2f} {s['mbps_process']:21.2f} "
              f"{str(r['docs_read']):>10} {r['docs_kept']:>10} {r['text_bytes_kept'] / MB:9.3f}")
    for side, s in summary.items():
        print(f"{side} drops: {json.dumps(s['res']['drops'], sort_keys=True)}")
        print(f"{side} versions: {json.dumps(s['res']['versions'])}")
    ratio = ratio_proc = None
    if "ours" in summary and "datatrove" in summary:
        ratio = summary["ours"]["mbps"] / summary["datatrove"]["mbps"]
        ratio_proc = summary["ours"]["mbps_process"] / summary["datatrove"]["mbps_process"]
        print(f"\nratio ours/datatrove (MB/s per core, loop): {ratio:.2f}x   incl. imports+model load: {ratio_proc:.2f}x"
              f"   goal >= 2x: {'met' if ratio >= 2 else 'NOT met'}")
    elif dt_error:
        print(f"\ndatatrove not measured: {dt_error}")

    if args.no_tsv:
        return
    ours_v = summary["ours"]["res"]["versions"]
    dt_v = summary.get("datatrove", {}).get("res", {}).get("versions")
    versions = (f"py {ours_v['python']} numpy {ours_v['numpy']} pyarrow {ours_v['pyarrow']} fasttext {ours_v['fasttext']} "
                f"zstandard {ours_v['zstandard']} dormouse {git_rev()}")
    if dt_v:
        versions += (f"; datatrove venv: py {dt_v['python']} datatrove {dt_v['datatrove']} numpy {dt_v['numpy']} "
                     f"fasttext-numpy2-wheel {dt_v['fasttext-numpy2-wheel']} spacy {dt_v['spacy']} orjson {dt_v['orjson']}")
    kept = {s: summary[s]["res"]["docs_kept"] for s in summary}
    reps = {s: [round(r["loop_s"], 2) for r in results[s]] for s in summary}
    note_common = (f"input {inp['files']} demo jsonl.zst, {inp['docs']} docs, {text_mb:.2f} MB text; preset {args.preset}; "
                   f"median of {args.reps}, loop s per rep {reps}; 1 task pinned taskset -c {args.cpu}; kept docs {kept}")
    mismatch = ("mismatch: C4 doc rules (lorem ipsum, line>2000 B) via LambdaFilter"
                + (" + C4QualityFilter(lorem only, rewrites text)" if args.dt_c4 == "builtin" else "")
                + ("; datatrove Gopher words = spaCy (its English default)"
                   if args.dt_words == "spacy" else "; datatrove Gopher words = str.split via a custom WordTokenizer (as ours)")
                + "; datatrove counts distinct stop words; dup 5-10-gram rules off; "
                  "fastText per doc (dt) vs batches of 512 (ours)")
    rows = []
    base = {"date": date, "machine": machine, "versions": versions, "command": command}
    o = summary["ours"]
    d = summary.get("datatrove")
    sfx = "" if (args.dt_words, args.dt_c4) == ("spacy", "lambda") else f"_dt_{args.dt_words}_{args.dt_c4}"
    rows.append({**base, "metric": f"filter_ours_MBps_per_core_loop{sfx}", "value": f"{o['mbps']:.3f}",
                 "baseline": f"{d['mbps']:.3f}" if d else "", "ratio": f"{ratio:.3f}" if ratio else "",
                 "note": f"baseline = datatrove 0.10.1 same pipeline; excl. imports+model load; {note_common}; {mismatch}"})
    if d:
        rows.append({**base, "metric": f"filter_datatrove_MBps_per_core_loop{sfx}", "value": f"{d['mbps']:.3f}",
                     "baseline": "", "ratio": "", "note": f"{note_common}; {mismatch}"})
    rows.append({**base, "metric": f"filter_ours_MBps_per_core_process{sfx}", "value": f"{o['mbps_process']:.3f}",
                 "baseline": f"{d['mbps_process']:.3f}" if d else "", "ratio": f"{ratio_proc:.3f}" if ratio_proc else "",
                 "note": f"whole subprocess wall clock incl. imports and model load (ours {o['res']['model_load_s']:.2f} s"
                         + (f", datatrove {d['res']['model_load_s']:.2f} s incl. spaCy" if d else "") + f"); {note_common}"})
    if not d:
        rows[0]["note"] += f"; datatrove not measured: {dt_error}"
    append_tsv(rows)
    print(f"appended {len(rows)} rows to {TSV.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
