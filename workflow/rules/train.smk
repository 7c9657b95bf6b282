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
        jobfile=stage_job_file("pretrain"),
        # N > 1 GPUs: one process per GPU under torchrun (DDP). A command line made here (unquoted in the shell).
        # A function of resources, so no rerun trigger: the GPU count does not change the artifact (preset `resources:`, not digested).
        launch=lambda w, resources: (
            f"torchrun --standalone --nproc-per-node {resources.gpu} -m dormouse.cli"
            if resources.gpu > 1
            else "dormouse"
        ),
        # the presets that plan this digest, for the stage's messages: no rerun trigger either
        presets=lambda w, resources: ",".join(PLAN.presets_of("pretrain", w.d)),
    threads: lambda w: 2 * max(1, PLAN.gpus("pretrain", w.d))
    resources:
        mem_mb=lambda w: PLAN.mem_mb("pretrain", w.d),
        runtime=lambda w: PLAN.runtime_min("pretrain", w.d),
        gpu=lambda w: PLAN.gpus("pretrain", w.d),
        nodes=1,  # torchrun --standalone: every rank on one node (SLURM: --nodes=1 --gpus=N)
        **slurm(gpu=True),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse gpu-run --gpus {resources.gpu} -- {params.launch} pretrain --job @{params.jobfile:q} --presets {params.presets:q} --terminal-progress 2>&1 > {log:q} || {{ tail -n 25 {log:q} >&2; exit 1; }}"


rule pretrain_view:
    """results/<view>/pretrain.json: final eval BPB, the curve, counters and the digest chain."""
    input:
        pretrain=view_input("pretrain"),
    output:
        "results/{view}/pretrain.json",
    log:
        "results/logs/view/{view}.pretrain.log",
    benchmark:
        "results/benchmarks/view/{view}.pretrain.tsv"
    params:
        store=STORE,
        **view_params(),
        history="results/history.jsonl",  # appended from the finished artifact, once per digest (dormouse history)
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse view pretrain --preset {params.preset} --view {wildcards.view} --overrides {params.overrides:q} --artifact {input.pretrain:q} --store {params.store:q} "
        "--history {params.history:q} --out {output:q} > {log:q} 2>&1"


rule sft:
    """Fine-tune the pretrained model on the verifiable tasks; accuracy and BPB at start and end."""
    input:
        unpack(stage_inputs("sft")),
    output:
        manifest=f"{STORE}/sft/{{d}}/manifest.json",
    log:
        "results/logs/sft/{d}.log",
    benchmark:
        "results/benchmarks/sft/{d}.tsv"
    params:
        job=stage_job("sft"),
        jobfile=stage_job_file("sft"),
    threads: 2
    resources:
        mem_mb=lambda w: PLAN.mem_mb("sft", w.d),
        runtime=lambda w: PLAN.runtime_min("sft", w.d),
        gpu=lambda w: PLAN.gpus("sft", w.d),
        **slurm(gpu=True),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse gpu-run --gpus {resources.gpu} -- dormouse sft --job @{params.jobfile:q} --terminal-progress 2>&1 > {log:q} || {{ tail -n 25 {log:q} >&2; exit 1; }}"


rule rl:
    """GRPO on the verifiable tasks from the sft model; accuracy and BPB at start and end."""
    input:
        unpack(stage_inputs("rl")),
    output:
        manifest=f"{STORE}/rl/{{d}}/manifest.json",
    log:
        "results/logs/rl/{d}.log",
    benchmark:
        "results/benchmarks/rl/{d}.tsv"
    params:
        job=stage_job("rl"),
        jobfile=stage_job_file("rl"),
    threads: 2
    resources:
        mem_mb=lambda w: PLAN.mem_mb("rl", w.d),
        runtime=lambda w: PLAN.runtime_min("rl", w.d),
        gpu=lambda w: PLAN.gpus("rl", w.d),
        **slurm(gpu=True),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse gpu-run --gpus {resources.gpu} -- dormouse rl --job @{params.jobfile:q} --terminal-progress 2>&1 > {log:q} || {{ tail -n 25 {log:q} >&2; exit 1; }}"


rule export:
    """Quantized rungs of the final model, each loaded back and scored on the eval window."""
    input:
        unpack(stage_inputs("export")),
    output:
        manifest=f"{STORE}/export/{{d}}/manifest.json",
    log:
        "results/logs/export/{d}.log",
    benchmark:
        "results/benchmarks/export/{d}.tsv"
    params:
        job=stage_job("export"),
        jobfile=stage_job_file("export"),
    threads: 2
    resources:
        mem_mb=lambda w: PLAN.mem_mb("export", w.d),
        runtime=lambda w: PLAN.runtime_min("export", w.d),
        gpu=lambda w: PLAN.gpus("export", w.d),
        **slurm(gpu=True),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse gpu-run --gpus {resources.gpu} -- dormouse export --job @{params.jobfile:q} --terminal-progress 2>&1 > {log:q} || {{ tail -n 25 {log:q} >&2; exit 1; }}"


rule bench:
    """Every stage and rung scored: BPB, task multiple choice and exact match, cloze, extra tasks."""
    input:
        unpack(stage_inputs("bench")),
    output:
        manifest=f"{STORE}/bench/{{d}}/manifest.json",
    log:
        "results/logs/bench/{d}.log",
    benchmark:
        "results/benchmarks/bench/{d}.tsv"
    params:
        job=stage_job("bench"),
        jobfile=stage_job_file("bench"),
    threads: 2
    resources:
        mem_mb=lambda w: PLAN.mem_mb("bench", w.d),
        runtime=lambda w: PLAN.runtime_min("bench", w.d),
        gpu=lambda w: PLAN.gpus("bench", w.d),
        **slurm(gpu=True),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse gpu-run --gpus {resources.gpu} -- dormouse bench --job @{params.jobfile:q} --terminal-progress 2>&1 > {log:q} || {{ tail -n 25 {log:q} >&2; exit 1; }}"


rule bench_view:
    """results/<view>/bench.json: every stage's and rung's scores, the anchors, the digest chain."""
    input:
        bench=view_input("bench"),
    output:
        "results/{view}/bench.json",
    log:
        "results/logs/view/{view}.bench.log",
    benchmark:
        "results/benchmarks/view/{view}.bench.tsv"
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
        "dormouse view bench --preset {params.preset} --view {wildcards.view} --overrides {params.overrides:q} --artifact {input.bench:q} --store {params.store:q} --out {output:q} > {log:q} 2>&1"


rule plots:
    """Figures for `snakemake --report`: curves vs the anchor ladder, the rung table, task scores."""
    input:
        bench="results/{view}/bench.json",
    output:
        curves=report("results/{view}/plots/curves.png", caption="../report/curves.rst", category="{view}"),
        rungs=report("results/{view}/plots/rungs.png", caption="../report/rungs.rst", category="{view}"),
        tasks=report("results/{view}/plots/tasks.png", caption="../report/tasks.rst", category="{view}"),
    log:
        "results/logs/view/{view}.plots.log",
    params:
        store=STORE,
        out_dir="results/{view}/plots",
    threads: 1
    resources:
        mem_mb=2000,
        runtime=5,
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse plots --bench {input.bench:q} --store {params.store:q} --out-dir {params.out_dir:q} > {log:q} 2>&1"


rule verdict:
    """An A/B experiment (config/experiments/<exp>.yaml): arms x seeds -> verdict.json + eval curves."""
    input:
        lambda w: PLAN.experiment_inputs(w.exp),
    output:
        verdict="results/ab/{exp}/verdict.json",
        curves=report("results/ab/{exp}/curves.png", caption="../report/verdict.rst", category="experiments"),
    log:
        "results/logs/ab/{exp}.log",
    params:
        experiment=lambda w: PLAN.experiment_json(w.exp),
        store=STORE,
    threads: 1
    resources:
        mem_mb=2000,
        runtime=5,
        **slurm(),
    conda:
        "../../envs/dormouse.yaml"
    shell:
        "dormouse verdict --experiment {params.experiment:q} --store {params.store:q} --out {output.verdict:q} --plot {output.curves:q} > {log:q} 2>&1"
