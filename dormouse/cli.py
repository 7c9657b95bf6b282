"""`dormouse <command>`: one entry point per stage, plus the plan, views and the demo corpus."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from dormouse.planner.registry import STAGES

# command -> (module, help line[, entry function name: default main]); the stages from their registry
COMMANDS = {
    **{s.name: (s.module, s.help) for s in STAGES.values()},
    "demo-corpus": ("dormouse.data.demo_corpus", "build corpus/demo from pinned package-registry sources"),
    "scale-corpus": ("dormouse.data.scale_corpus", "build corpus/scale (~4.3 GB of text) from pinned package-registry sources"),
    "corpus-slice": ("dormouse.data.corpus_slice", "a deterministic slice of a built corpus that keeps its mix (b1's chain on one GPU machine)"),
    "gpu-run": ("dormouse.train.devices", "run a command on free GPU slots (sets CUDA_VISIBLE_DEVICES)"),
    "plan": ("dormouse.planner.plan_cli", "print the plan, or one job's JSON to run a stage by hand"),
    "verify": ("dormouse.tools.verify", "re-hash artifacts against their manifests; exit 1 naming every altered file"),
    "retractions": ("dormouse.planner.retractions", "the retraction ledger: what each entry hits and superseded"),
    "plots": ("dormouse.tools.plots", "the report's figures from results/<preset>/bench.json and the store"),
    "verdict": ("dormouse.planner.experiments", "judge an A/B experiment's arms over seeds (WIN / LOSE / TIE / INVALID)"),
    "history": ("dormouse.tools.history", "pretrain throughput/memory history; --check fails on a regression (default tolerance 0.10)"),
    "view": ("dormouse.tools.views", "write a per-preset result file from an artifact and its chain"),
    "headline": ("dormouse.tools.headline", "what a run found: BPB against the anchors, task accuracy per stage, rungs"),
    "pack": ("dormouse.planner.transport", "an artifact into zstd parts of <= 60 MiB with their sha256 (to carry it)", "pack_main"),
    "unpack": ("dormouse.planner.transport", "verify carried parts and rebuild their artifact in the store", "unpack_main"),
    "lm-eval": ("dormouse.tools.lm_eval_adapter", "lm-evaluation-harness's CLI with the model \"dormouse\" registered (any artifact, any rung)"),
    "serve": ("dormouse.serve.app", "an OpenAI-compatible endpoint (streaming, batched decode) and a chat page for a model"),
}


# commands that need an optional extra: (the module that must import, the one line that installs it)
EXTRAS = {"lm-eval": ("lm_eval", "pip install -e '.[lmeval]'  (lm_eval==0.4.13; `make test` installs it too)")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        from dormouse.core.provenance import git_state

        git = git_state()
        where = f"git {git['git_commit'][:12]}{' dirty' if git['git_dirty'] else ''}" if git["git_commit"] else "no git checkout"
        print(f"dormouse {version('dormouse')} ({where})")
        return 0
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        print(f"dormouse: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (dormouse --help)", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dormouse <command> [args]      (dormouse --version)\n\ncommands:")
        for name, (_, help_, *_fn) in COMMANDS.items():
            print(f"  {name:12s} {help_}")
        return 0 if argv else 2
    from dormouse.core.config import ConfigError, InputError
    from dormouse.core.lifeline import tie_to_snakemake
    from dormouse.core.store import ArtifactError

    tie_to_snakemake()  # a job of a killed Snakemake does not run on as an orphan
    if argv[0] in EXTRAS and importlib.util.find_spec(EXTRAS[argv[0]][0]) is None:
        print(f"dormouse {argv[0]}: needs the {EXTRAS[argv[0]][0]} package, not installed here: {EXTRAS[argv[0]][1]}",
              file=sys.stderr)
        return 2
    module_name, _, *fn = COMMANDS[argv[0]]
    entry = getattr(importlib.import_module(module_name), fn[0] if fn else "main")
    try:
        return int(entry(argv[1:]) or 0)
    except (ConfigError, InputError) as e:  # the message names the file and the fix: one line, not a traceback
        print(f"dormouse {argv[0]}: {e}", file=sys.stderr)
        return 2
    except ArtifactError as e:  # a missing, cut or altered artifact file: the message names the artifact and file
        print(f"dormouse {argv[0]}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `dormouse plan | head`: the reader left; stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
