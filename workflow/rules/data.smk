rule filter:
    """fastText quality classifier + Gopher/C4 heuristics over the raw corpus; counted drops."""
    input:
        unpack(stage_inputs("filter")),
    output:
        manifest=f"{STORE}/filter/{{d}}/manifest.json",
    log:
        "results/logs/filter/{d}.log",
    benchmark:
        "results/benchmarks/filter/{d}.tsv"
    params:
        job=stage_job("filter"),
        jobfile=stage_job_file("filter"),
    threads: 8  # heuristics over this many processes (capped at --cores; the stage reads the grant from OMP_NUM_THREADS)
    resources:
        mem_mb=lambda w: PLAN.mem_mb("filter", w.d),
        runtime=lambda w: PLAN.runtime_min("filter", w.d),
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse filter --job @{params.jobfile:q} --terminal-progress 2>&1 > {log:q} || {{ tail -n 25 {log:q} >&2; exit 1; }}"


rule shard:
    """FNV-1a routing into N train shards plus an eval tail that never trains."""
    input:
        unpack(stage_inputs("shard")),
    output:
        manifest=f"{STORE}/shard/{{d}}/manifest.json",
    log:
        "results/logs/shard/{d}.log",
    benchmark:
        "results/benchmarks/shard/{d}.tsv"
    params:
        job=stage_job("shard"),
        jobfile=stage_job_file("shard"),
    threads: 1
    resources:
        mem_mb=lambda w: PLAN.mem_mb("shard", w.d),
        runtime=lambda w: PLAN.runtime_min("shard", w.d),
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse shard --job @{params.jobfile:q} --terminal-progress 2>&1 > {log:q} || {{ tail -n 25 {log:q} >&2; exit 1; }}"


rule anchors:
    """Bits per byte of uniform / unigram / k-gram backoff / Kneser-Ney models on the eval tail."""
    input:
        unpack(stage_inputs("anchors")),
    output:
        manifest=f"{STORE}/anchors/{{d}}/manifest.json",
    log:
        "results/logs/anchors/{d}.log",
    benchmark:
        "results/benchmarks/anchors/{d}.tsv"
    params:
        job=stage_job("anchors"),
        jobfile=stage_job_file("anchors"),
    threads: 1
    resources:
        mem_mb=lambda w: PLAN.mem_mb("anchors", w.d),
        runtime=lambda w: PLAN.runtime_min("anchors", w.d),
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse anchors --job @{params.jobfile:q} --terminal-progress 2>&1 > {log:q} || {{ tail -n 25 {log:q} >&2; exit 1; }}"


rule anchors_view:
    """results/<view>/anchors.json: the ladder plus the digest chain it came from."""
    input:
        anchors=view_input("anchors"),
    output:
        "results/{view}/anchors.json",
    log:
        "results/logs/view/{view}.anchors.log",
    benchmark:
        "results/benchmarks/view/{view}.anchors.tsv"
    params:
        store=STORE,
        **view_params(),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse view anchors --preset {params.preset} --view {wildcards.view} --overrides {params.overrides:q} --artifact {input.anchors:q} --store {params.store:q} --out {output:q} > {log:q} 2>&1"
