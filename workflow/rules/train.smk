rule pretrain:
    """Train the byte LM on the train shards; BPB on a fixed window of the eval tail."""
    input:
        unpack(stage_inputs("pretrain")),
    output:
        manifest=f"{STORE}/pretrain/{{d}}/manifest.json",
    log:
        "results/logs/pretrain/{d}.log",
    benchmark:
        "results/benchmarks/pretrain/{d}.tsv"
    params:
        job=stage_job("pretrain"),
    threads: 2
    resources:
        mem_mb=16000,
        runtime=24 * 60,
        gpu=lambda w: PLAN.gpus("pretrain", w.d),
        **slurm(gpu=True),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse gpu-run --gpus {resources.gpu} -- dormouse pretrain --job {params.job:q} > {log} 2>&1"


rule pretrain_view:
    """results/<preset>/pretrain.json: final eval BPB, the curve, counters and the digest chain."""
    input:
        pretrain=view_input("pretrain"),
    output:
        "results/{preset}/pretrain.json",
    log:
        "results/logs/view/{preset}.pretrain.log",
    benchmark:
        "results/benchmarks/view/{preset}.pretrain.tsv"
    params:
        store=STORE,
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse view pretrain --preset {wildcards.preset} --artifact {input.pretrain} --store {params.store} --out {output} > {log} 2>&1"
