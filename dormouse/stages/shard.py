"""shard: filtered documents -> N train shards routed by a hash of the id, plus an eval tail.

    dormouse shard --job "$(dormouse plan --preset tiny --stage shard)"

The hash is `fnv.doc_hash` (FNV-1a 64 of the id, then mixed: FNV-1a's top bits alone group ids that
differ in a suffix, which would make the tail runs of neighbouring ids). The eval tail is held out by
GROUP: a document's group is its id with `part_pattern` deleted (the parts of one split source file,
e.g. a novel's chapters `austen/emma#003`), and the tail is the groups with the smallest doc_hash of
the group id, taken until `eval_tail_bytes`; a document is eval iff its group's hash <= the recorded
cutoff, so membership depends on the id alone, and no held-out text has a sibling part in training (the
demo's tail had 28% of its bytes in such parts when documents were drawn one by one). Train documents
go to shard `doc_hash(id) % num_shards`. A train document whose text is byte-identical to an eval
document is dropped (counted): the eval tail never trains, not even through a copy.

Layout: dormouse/data/shards.py (train/shard-NNNN.*, eval/tail.*, shards.json); documents in hash order
(domains mixed, not corpus order).
"""

from __future__ import annotations

from dormouse.data.shards import shard_documents
from dormouse.planner.job import input_artifact, parse_job, summary, writer


def main(argv=None) -> int:
    job = parse_job(argv, "shard", __doc__)
    filtered = input_artifact(job, "filter")
    parts = [filtered.file(n) for n in filtered.files("docs-")]
    with writer(job) as art:
        sizing = {k: v for k, v in job["params"].items() if k.startswith("eval_tail_") and k != "eval_tail_bytes"}
        shard_documents(parts, job["params"]["num_shards"], job["params"]["eval_tail_bytes"], art,
                        job["params"]["part_pattern"], sizing)
        summary("shard", art.counters)
    return 0
