"""The fastText quality classifier measured (issue #29 item 3): precision and recall of its keep/drop decision
on held-out labelled examples, against the majority-class baseline, and its size on disk, per configuration.

    .venv/bin/python -m benchmarks.quality_filter_bench [--preset tiny] [--folds 5]

Examples: the preset's `data.filter.quality.positive` / `negative` sets (the demo's by default), read as the
filter reads them and cut into pieces as it trains (`quality.example_pieces`). The filter holds out 10 % by
hash, which on the demo leaves 4 negative pieces: too few to measure. Here every document is held out once:
K folds by FNV-1a of the document's id (a document's pieces stay together), a classifier trained on the other
folds with the filter's own `quality.train`, each held-out piece scored with `quality.score`. The decision is
the preset's: keep when P(hq) >= threshold. Reported over all folds: for the drop decision (finding the
negatives) precision and recall; for the keep decision precision; accuracy; and the same for the majority
class (keep everything, as a filter without a classifier). Size: the saved .bin, and the .ftz of fastText's
own `quantize` (product quantization, qnorm) for the same model. Rows go to benchmarks/results.tsv.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.bench_env import ROOT, append_tsv, cpu_model, git_rev, mem_gib, rerun_command
from dormouse.data import quality  # noqa: E402
from dormouse.data.fnv import fnv1a_64  # noqa: E402
from dormouse.data.readers import ReaderConfig  # noqa: E402
from dormouse.core.config import load_preset  # noqa: E402
from dormouse.data.readers import iter_records  # noqa: E402

CONFIGS = {  # name -> overrides of the preset's quality.train
    "preset": {},
    "bucket50k": {"bucket": 50_000},  # (dim 16 at bucket 50k hit NaN at every lr from 0.5 down to 0.0125)
}


def pieces(preset: dict) -> list[tuple[str, int, str]]:
    """(label, fold key, piece text) of every example piece."""
    q = preset["data"]["filter"]["quality"]
    cfg = ReaderConfig(**preset["data"]["reader"])
    out = []
    for side, label in (("positive", q.get("label_hq", "__label__hq")), ("negative", quality.LABEL_LQ)):
        for rec in iter_records([str(ROOT / s) for s in q[side]], cfg, Counter()):
            if rec.skip or not rec.text.strip():
                continue
            key = fnv1a_64(f"{side}:{rec.id}")
            out += [(label, key, p) for p in quality.example_pieces(rec.text, q["train"]["example_piece_bytes"])]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--no-tsv", action="store_true")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    preset = load_preset(args.preset)
    q = preset["data"]["filter"]["quality"]
    hq, threshold = q.get("label_hq", "__label__hq"), q["threshold"] if q["threshold"] is not None else 0.5
    data = pieces(preset)
    n_neg = sum(label != hq for label, _, _ in data)
    print(f"[quality_bench] {len(data)} pieces ({n_neg} negative) from {q['positive']} / {q['negative']}; "
          f"{args.folds} folds; keep at P(hq) >= {threshold}", flush=True)
    rows = []
    thresholds = sorted({threshold, 0.5, 0.8})
    for name, over in CONFIGS.items():
        tcfg = {**q["train"], **over}
        for form in ("bin", "ftz"):
            judged = []  # (is positive, P(hq)) of every held-out piece
            size = 0
            t0 = time.time()
            for fold in range(args.folds):
                train = [(lab, p) for lab, key, p in data if key % args.folds != fold]
                test = [(lab, p) for lab, key, p in data if key % args.folds == fold]
                with tempfile.TemporaryDirectory() as tmp:
                    tf = Path(tmp) / "train.txt"
                    quality.write_training_file(tf, train, tcfg["seed"])
                    try:
                        model, _ = quality.train(tf, tcfg, Counter(), "the example sets")
                    except SystemExit as e:  # NaN at every rate: that configuration's result
                        print(f"[quality_bench] {name}: {e}", flush=True)
                        break
                    if form == "ftz":
                        model.quantize(input=str(tf), qnorm=True, retrain=False)
                    path = Path(tmp) / f"m.{form}"
                    model.save_model(str(path))
                    size = max(size, path.stat().st_size)
                scores = quality.score(model, [quality.prepare(p) for _, p in test], hq)
                judged += [(lab == hq, sc) for (lab, _), sc in zip(test, scores, strict=True)]
            if len(judged) < len(data):
                continue
            for th in thresholds:
                conf = Counter((pos, sc >= th) for pos, sc in judged)  # (is positive, kept)
                tp_drop, fp_drop = conf[(False, False)], conf[(True, False)]  # negatives dropped, positives dropped
                kept_pos, kept_neg = conf[(True, True)], conf[(False, True)]
                row = {"config": f"{name}.{form} @{th}", "size_mb": size / 1e6,
                       "drop_precision": tp_drop / max(tp_drop + fp_drop, 1), "drop_recall": tp_drop / max(n_neg, 1),
                       "keep_precision": kept_pos / max(kept_pos + kept_neg, 1),
                       "accuracy": (tp_drop + kept_pos) / len(judged), "seconds": time.time() - t0}
                rows.append(row)
                print(f"[quality_bench] {row['config']:30s} {row['size_mb']:7.2f} MB  drop P {row['drop_precision']:.3f} "
                      f"R {row['drop_recall']:.3f}  keep P {row['keep_precision']:.3f}  acc {row['accuracy']:.3f}", flush=True)
    majority = (len(data) - n_neg) / len(data)
    print(f"[quality_bench] majority class (keep all): keep P {majority:.3f}, drop recall 0, accuracy {majority:.3f}")
    if not args.no_tsv:
        cmd = rerun_command("benchmarks.quality_filter_bench", argv, python="python")
        base = {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_model()}; {os.cpu_count()} cores; {mem_gib():.0f} GiB",
                "versions": f"python {sys.version.split()[0]}, fasttext 0.9.3", "command": cmd}
        append_tsv([{**base, "metric": f"quality classifier {r['config']}: accuracy ({len(data)} pieces, {n_neg} negative, "
                                       f"{args.folds}-fold)", "value": f"{r['accuracy']:.3f}", "baseline": f"{majority:.3f}",
                     "ratio": f"{r['accuracy'] / majority:.3f}",
                     "note": f"drop precision {r['drop_precision']:.3f} recall {r['drop_recall']:.3f}; keep precision "
                             f"{r['keep_precision']:.3f}; {r['size_mb']:.2f} MB; git {git_rev()}"} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
