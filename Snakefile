# dormouse: raw corpus -> filter -> shard -> anchors (-> pretrain -> sft -> rl -> export -> bench).
# `snakemake` builds results/<config.preset>/{anchors,pretrain,bench}.json; `snakemake results/<preset>/anchors.json`
# builds another preset. The plan (preset -> stage -> digest) is made once, at parse time. A run with --config
# overrides (set=, corpus=, ...) writes its views to results/<preset>@<tag>/ instead (workflow/rules/common.smk).
import time

from snakemake.utils import min_version

min_version("9.20")
STARTED = time.time()  # the headline below names the bench.json files this run wrote


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


rule all:
    input:
        f"results/{PLAN.view_name(config['preset'])}/anchors.json",
        f"results/{PLAN.view_name(config['preset'])}/pretrain.json",
        f"results/{PLAN.view_name(config['preset'])}/bench.json",
        f"results/{PLAN.view_name(config['preset'])}/plots/curves.png",
    default_target: True


onsuccess:
    shell(f"dormouse headline --since {STARTED} || true")  # what the run found; never fails the run


include: "workflow/rules/corpus.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
