"""Quantization-aware training (dormouse/train/qat.py): the fake-quantized forward is the rung file's forward,
gradients reach the fp32 master weights through the straight-through estimator, and QAT cannot be silently off."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from model_util import live_model, rand_bytes
from pipeline_util import configure, run_chain

from dormouse.cli import main as dormouse_main
from dormouse.data import shards as layout
from dormouse.data.byte_stream import eval_window
from dormouse.core.config import ConfigError, load_preset, load_yaml, validate
from dormouse.planner.registry import POSTTRAIN_LATER_DEFAULTS, stage_params
from dormouse.train.settings import OptimSettings, TRAIN_LATER_DEFAULTS
from dormouse.core.store import artifact_digest, open_artifact
from dormouse.tools.views import main as view_main
from dormouse.model.config import ModelConfig
from dormouse.model.regions import compile_regions
from dormouse.model import quant
from dormouse.model.quant import rung_source_state
from dormouse.train.optim import build_optimizers
from dormouse.train.arms import finish_start
from dormouse.train.qat import QAT_RUNGS, FakeQuant
from dormouse.train.runtime import evaluate, load_model

ROOT = Path(__file__).resolve().parents[1]

CFG = ModelConfig(d_model=64, n_heads=2, head_dim=32, ffn_hidden=96, n_core=2, kda_chunk_size=16,
                  engram=True, engram_rows=97, engram_dim=8)
TRAIN = {"optimizer": "muon", "lr": 3e-3, "muon_lr": 2e-2, "weight_decay": 0.0}


def exported(model, rung: str, path) -> torch.nn.Module:
    """The model as export writes the rung and loads it back (the export stage's calls)."""
    quant.save_rung(path, rung_source_state(model), rung, eligible=quant.eligible_for(rung))
    return quant.load_rung_model(path, model.cfg, torch.device("cpu"))


@pytest.mark.parametrize("rung", QAT_RUNGS)
def test_the_quantized_forward_is_the_exported_rung_and_not_the_plain_one(rung, tmp_path, one_thread):
    model = live_model(CFG)
    fq = FakeQuant(model, rung)
    x = rand_bytes(2, 40)
    with torch.no_grad():
        plain = model(x)[0]
        with fq.applied():
            seen = model(x)[0]
        back = exported(model, rung, tmp_path / f"{rung}.safetensors")(x)[0]
    torch.testing.assert_close(seen, back, atol=0, rtol=0)
    assert (seen - plain).abs().max() > 1e-4  # QAT on is a different forward (a silent no-op fails here)
    recipe = quant.read_rung(tmp_path / f"{rung}.safetensors")[1]
    assert fq.quantized == sorted(n for n, e in recipe["tensors"].items() if e["rule"] == rung)  # export's tensors
    assert fq.applications == 1
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], plain, atol=0, rtol=0)  # the context leaves the model as it was


def test_gradients_flow_straight_through_to_the_fp32_masters(one_thread):
    model = live_model(CFG).train()
    fq = FakeQuant(model, "ternary")
    x, y = rand_bytes(2, 40), rand_bytes(2, 40, seed=2)
    keys = list(model.state_dict())
    with fq.applied():
        assert list(model.state_dict()) == keys and all(type(p) is torch.nn.Parameter for p in model.parameters())
        _, loss = model(x, y)
    loss.backward()
    # straight through: the gradient at W is the gradient at Q(W), i.e. a plain model holding the rung's values
    twin = live_model(CFG).train()
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(quant.fake_quant(fq.rules[name], dict(model.named_parameters())[name]))
    twin(x, y)[1].backward()
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in fq.quantized)
    # Muon and AdamW step the masters, which stay fp32 and off the ternary grid
    opts = build_optimizers(model, OptimSettings.of(TRAIN))
    for opt in opts:
        opt.step()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert fq.moved() == len(fq.quantized) > 0


def test_only_export_eligible_matrices_see_the_rung_and_narrow_ones_stay_bf16():
    cfg = ModelConfig(d_model=48, n_heads=2, head_dim=24, ffn_hidden=96, n_core=1, kda_chunk_size=16)
    model = live_model(cfg)
    fq = FakeQuant(model, "nvfp4")
    assert fq.quantized and all(quant.default_eligible(n, model.get_parameter(n)) for n in fq.quantized)
    assert not any(n.endswith(("embed.weight", "head.weight")) for n in fq.quantized)
    assert {r for r in fq.rules.values()} == {"nvfp4", "bf16"}
    with pytest.raises(ValueError, match="qat rung"):
        FakeQuant(model, "bf16")


def test_finish_start():
    assert finish_start(200, 0.2) == 160 and finish_start(200, 0.0) == 200 and finish_start(10, 1.0) == 0


def test_qat_keys_at_their_default_stay_out_of_the_digest():
    """train.qat, sft.qat and rl.qat came after the digests were pinned: null (off) leaves every params slice as it
    was; a rung enters its stage's slice."""
    schema = load_yaml(ROOT / "dormouse" / "schemas" / "preset.schema.yaml")["properties"]
    assert {k: schema["train"]["properties"][k]["default"] for k in TRAIN_LATER_DEFAULTS} == TRAIN_LATER_DEFAULTS
    for stage in ("sft", "rl"):
        assert {k: schema[stage]["properties"][k]["default"] for k in POSTTRAIN_LATER_DEFAULTS} == POSTTRAIN_LATER_DEFAULTS
    preset = load_preset("tiny", ROOT)
    assert preset["train"]["qat"] is None and preset["sft"]["qat"] is None
    assert "qat" not in stage_params("pretrain", preset)["train"]
    assert all("qat" not in stage_params(s, preset)[s] for s in ("sft", "rl"))
    preset = load_preset("tiny", ROOT, "train.qat={rung: ternary, fraction: 0.2},sft.qat=ternary,rl.qat=nvfp4")
    assert stage_params("pretrain", preset)["train"]["qat"] == {"rung": "ternary", "fraction": 0.2}
    assert stage_params("sft", preset)["sft"]["qat"] == "ternary" and stage_params("rl", preset)["rl"]["qat"] == "nvfp4"
    assert "ptq_rungs" not in stage_params("pretrain", preset)["train"]
    preset = load_preset("tiny", ROOT, "train.ptq_rungs=[mxfp4, nvfp4]")
    assert stage_params("pretrain", preset)["train"]["ptq_rungs"] == ["mxfp4", "nvfp4"]
    with pytest.raises(ConfigError, match="train.ptq_rungs lists ternary, the rung of train.qat"):
        stage_params("pretrain", load_preset("tiny", ROOT, "train.qat={rung: ternary, fraction: 0.2},train.ptq_rungs=[ternary]"))
    with pytest.raises(ConfigError, match="non-unique"):
        load_preset("tiny", ROOT, "train.ptq_rungs=[mxfp4, mxfp4]")


# --------------------------------------------------------------------------------------------------
# The stages: a pretrain with a QAT finish, and export of its rung
# --------------------------------------------------------------------------------------------------
QAT_MODEL = {"d_model": 64, "n_heads": 2, "head_dim": 32, "ffn_hidden": 128, "n_core": 1, "kda_chunk_size": 16}
QAT_TRAIN = {"device": "cpu", "steps": 16, "batch_size": 4, "seq_len": 32, "eval_every": 8, "eval_bytes": 2048,
             "ckpt_every": 8, "log_every": 4, "warmup_steps": 4, "qat": {"rung": "ternary", "fraction": 0.25}}


def run_job(work, stage: str, spec: dict) -> dict:
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert dormouse_main([stage, "--job", json.dumps(spec)]) == 0
    finally:
        os.chdir(cwd)
    return json.loads((work / spec["out"] / "manifest.json").read_text())


def configure_qat(workdir, small_corpus, quality_examples, export: dict | None = None, **train) -> dict:
    """The workflow copy's tiny preset as QAT_MODEL with QAT_TRAIN (and `train`'s overrides); its config."""
    config = configure(workdir, small_corpus, *quality_examples)
    path = workdir / "config" / "presets" / "tiny.yaml"
    preset = yaml.safe_load(path.read_text())
    preset["model"], preset["train"] = QAT_MODEL, {**QAT_TRAIN, **train}
    if export is not None:
        preset["export"] = export
    path.write_text(yaml.safe_dump(preset, sort_keys=False))
    return config


def test_a_pretrain_finish_runs_through_the_rung_and_export_reproduces_its_bpb(workdir, small_corpus, quality_examples):
    """The acceptance of issue #28 item 2 on CPU: pretrain with a ternary finish over its last 4 of 16 steps; the
    export stage's ternary file (export run on that artifact) scores the pretrain's final eval BPB on the same window."""
    config = configure_qat(workdir, small_corpus, quality_examples, export={"rungs": ["bf16", "ternary", "nvfp4"]},
                           ptq_rungs=["nvfp4"])
    plan = run_chain(workdir, config, stages=("filter", "shard", "pretrain"))
    pre_digest = plan.chain["tiny"]["pretrain"]
    m = json.loads((workdir / plan.manifest_path("pretrain", pre_digest)).read_text())
    c, final = m["counters"], m["final"]
    assert m["params"]["train"]["qat"] == QAT_TRAIN["qat"]
    assert c["train.qat.steps"] == 4 and c["eval.qat.evals"] == 1
    assert c["qat.tensors.ternary"] == c["qat.tensors_moved"] == len(final["qat"]["tensors"]) > 0
    assert final["qat"]["from_step"] == 12 and final["qat"]["steps"] == 4
    rows = [json.loads(line) for line in (workdir / plan.artifact_dir("pretrain", pre_digest) / "metrics.jsonl").open()]
    evals = [r for r in rows if "eval_bpb" in r]
    assert [r.get("eval_rung") for r in evals] == [None, "ternary"]  # step 8 plain, step 16 through the rung
    assert final["eval_bpb"] == evals[-1]["eval_bpb"] != final["eval_bpb_master"]

    # export, run on the pretrain artifact as its source model
    spec = plan.job("export", plan.chain["tiny"]["export"]).spec(plan.store)
    spec["inputs"]["rl"] = {"kind": "artifact", "stage": "pretrain", "digest": pre_digest}
    spec["digest"] = artifact_digest("export", spec["format_version"], spec["params"],
                                     {k: v["digest"] for k, v in spec["inputs"].items()}, spec["retractions"])
    spec["out"] = f"{plan.store}/export/{spec['digest']}"
    rungs = run_job(workdir, "export", spec)["final"]
    assert rungs["qat"] == [{"stage": "pretrain", "rung": "ternary", "steps": 4, "tensors": c["qat.tensors.ternary"]}]
    rungs = rungs["rungs"]
    assert {r: v["method"] for r, v in rungs.items()} == {"bf16": "ptq", "ternary": "qat", "nvfp4": "ptq"}
    assert rungs["ternary"]["quantized_tensors"] == c["qat.tensors.ternary"]
    assert rungs["ternary"]["bpb"] == final["eval_bpb"]  # both rounded to 5 decimals
    # train.ptq_rungs: pretrain's own PTQ figure of another rung is what export measures on that rung's file
    assert c["eval.ptq.nvfp4.evals"] == 1 and final["eval_bpb_ptq"] == {"nvfp4": rungs["nvfp4"]["bpb"]}
    # unrounded: the exported file's BPB and the QAT forward's on the same window
    art = open_artifact(workdir / plan.artifact_dir("pretrain", pre_digest), stage="pretrain")
    shards = open_artifact(workdir / plan.artifact_dir("shard", plan.chain["tiny"]["shard"]), stage="shard")
    ex, ey, _ = eval_window(layout.eval_bin(shards), QAT_TRAIN["eval_bytes"], QAT_TRAIN["seq_len"])
    model, _ = load_model(art, torch.device("cpu"))
    with FakeQuant(model, "ternary").applied():
        qat_bpb = evaluate(model, ex, ey, 4, torch.device("cpu"), "bfloat16", Counter())
    rung_model = quant.load_rung_model(workdir / spec["out"] / "rungs" / "ternary.safetensors", model.cfg, torch.device("cpu"))
    assert evaluate(rung_model, ex, ey, 4, torch.device("cpu"), "bfloat16", Counter()) == pytest.approx(qat_bpb, abs=1e-6)
    assert evaluate(model, ex, ey, 4, torch.device("cpu"), "bfloat16", Counter()) == pytest.approx(final["eval_bpb_master"], abs=1e-5)


def test_a_finish_of_micro_batches_counts_each_forward_through_the_rung(workdir, small_corpus, quality_examples):
    """train.micro_batch_size with a finish: each micro-batch enters the rung's forward, so the stage's check that
    the finish ran counts steps x micro-batches (it once failed the run after its last step)."""
    config = configure_qat(workdir, small_corpus, quality_examples, micro_batch_size=2)
    plan = run_chain(workdir, config, stages=("filter", "shard", "pretrain"))
    c = json.loads((workdir / plan.manifest_path("pretrain", plan.chain["tiny"]["pretrain"])).read_text())["counters"]
    assert c["train.qat.steps"] == 4 and c["train.micro_batches"] == 16 * 2
    assert c["qat.contexts"] == 4 * 2 + c["eval.qat.evals"]


def test_a_branched_finish_is_the_whole_run_continued_from_its_trunks_checkpoint(workdir, small_corpus, quality_examples):
    """An experiment with branch: the control keeps its checkpoint at the finish start (step 12 of 16) in its artifact,
    and the arm's pretrain (a trunk input) trains only steps 12..15 from there; on CPU its weights and curve are the
    unbranched run's bit for bit. A trunk that trained other params is refused before any step."""
    config = configure_qat(workdir, small_corpus, quality_examples)  # tiny: the finish over steps 12..15, unbranched
    exp = {"base": "tiny", "seeds": [QAT_TRAIN.get("seed", 0)], "steps": 16, "branch": True,
           "control": {"train": {"qat": None, "ptq_rungs": ["ternary"]}},
           "arms": {"fin": {"train": {"qat": QAT_TRAIN["qat"]}}}}
    (workdir / "config" / "experiments" / "br.yaml").write_text(yaml.safe_dump(exp))
    plan = run_chain(workdir, config, stages=("filter", "shard", "pretrain"))
    control, arm = plan.chain["ab/br/control/s0"]["pretrain"], plan.chain["ab/br/fin/s0"]["pretrain"]
    assert plan.job("pretrain", control).params["train"]["keep_checkpoints"] == [12]
    assert plan.job("pretrain", arm).inputs["trunk"]["digest"] == control
    run_chain(workdir, config, "ab/br/control/s0", stages=("pretrain",))
    run_chain(workdir, config, "ab/br/fin/s0", stages=("pretrain",))

    whole, branched = (workdir / plan.artifact_dir("pretrain", d) for d in (plan.chain["tiny"]["pretrain"], arm))
    trunk = json.loads((workdir / plan.manifest_path("pretrain", control)).read_text())
    assert {f for f in trunk["files"] if f.startswith("checkpoints/")} == {
        f"checkpoints/step-00000012/{f}" for f in ("model.safetensors", "optim.pt", "snapshot.json")}
    c = json.loads((branched / "manifest.json").read_text())["counters"]
    assert c["train.branched_from_step"] == 12 and c["train.steps_run_this_process"] == 4 and "resumed_from_step" not in c
    assert c["train.qat.steps"] == 4
    kept = trunk["files"]["checkpoints/step-00000012/model.safetensors"]["sha256"]
    assert json.loads((branched / "manifest.json").read_text())["final"]["branched_from"] == {
        "digest": control, "step": 12, "weights_sha256": kept}
    assert (branched / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    strip = lambda d: [{k: v for k, v in json.loads(r).items() if k != "tokens_per_s"} for r in (d / "metrics.jsonl").open()]
    assert strip(branched) == strip(whole)

    shutil.rmtree(branched)  # a trunk of other params (its manifest says so) is no trunk
    trunk["params"]["train"]["lr"] = trunk["params"]["train"]["lr"] * 2
    (workdir / plan.manifest_path("pretrain", control)).write_text(json.dumps(trunk))
    with pytest.raises(SystemExit, match=r"trained other params than this run before its finish \(\['lr'\]\)"):
        run_chain(workdir, config, "ab/br/fin/s0", stages=("pretrain",))


def test_a_control_killed_between_its_kept_and_periodic_saves_still_keeps_its_checkpoint(workdir, small_corpus,
                                                                                          quality_examples, monkeypatch):
    """A kept step that is also a periodic checkpoint step (8 of 16, ckpt_every 8): a kill between the two saves must
    not leave a resume that starts past the kept step (it would never keep it, and every rerun would fail)."""
    from dormouse.train import checkpoint
    from dormouse.train.finish import KEPT

    config = configure_qat(workdir, small_corpus, quality_examples, qat={"rung": "ternary", "fraction": 0.5})
    exp = {"base": "tiny", "seeds": [0], "steps": 16, "branch": True, "control": {"train": {"qat": None, "ptq_rungs": ["ternary"]}},
           "arms": {"fin": {"train": {"qat": {"rung": "ternary", "fraction": 0.5}}}}}
    (workdir / "config" / "experiments" / "br.yaml").write_text(yaml.safe_dump(exp))
    plan = run_chain(workdir, config, stages=("filter", "shard"))
    save, saved = checkpoint.save, []

    def die_after_the_first_save_at_8(root, step, *args, **kwargs):
        out = save(root, step, *args, **kwargs)
        saved.append((root.name, step))
        if step == 8:
            raise RuntimeError("killed between the two saves of step 8")
        return out

    monkeypatch.setattr(checkpoint, "save", die_after_the_first_save_at_8)
    with pytest.raises(RuntimeError, match="killed"):
        run_chain(workdir, config, "ab/br/control/s0", stages=("pretrain",))
    assert saved == [(KEPT, 8)]
    monkeypatch.setattr(checkpoint, "save", save)
    run_chain(workdir, config, "ab/br/control/s0", stages=("pretrain",))
    m = json.loads((workdir / plan.manifest_path("pretrain", plan.chain["ab/br/control/s0"]["pretrain"])).read_text())
    assert "checkpoints/step-00000008/snapshot.json" in m["files"] and m["counters"]["checkpoints_kept"] == 1
    assert m["counters"]["train.checkpoints_written"] == 1  # the periodic one at 8; kept ones are counted apart


def test_a_run_killed_inside_the_finish_resumes_to_the_same_weights_and_counts(workdir, small_corpus, quality_examples,
                                                                                 monkeypatch):
    """A checkpoint taken inside the finish (step 14 of 16; the finish is 12..15) resumes through the rung: the same
    weights, metrics and qat counts as an uninterrupted run (CPU: bit for bit)."""
    from dormouse.train import checkpoint

    config = configure_qat(workdir, small_corpus, quality_examples, ckpt_every=7)
    plan = run_chain(workdir, config, stages=("filter", "shard", "pretrain"))
    out = workdir / plan.artifact_dir("pretrain", plan.chain["tiny"]["pretrain"])
    reference = {f: (out / f).read_bytes() for f in ("model.safetensors", "metrics.jsonl")}
    ref_counters = json.loads((out / "manifest.json").read_text())["counters"]
    shutil.rmtree(out)

    save = checkpoint.save

    def save_then_die(root, step, *args):
        save(root, step, *args)
        if step == 14:
            raise RuntimeError("killed after the checkpoint at step 14")

    monkeypatch.setattr(checkpoint, "save", save_then_die)
    with pytest.raises(RuntimeError, match="step 14"):
        run_chain(workdir, config, stages=("pretrain",))
    monkeypatch.setattr(checkpoint, "save", save)
    run_chain(workdir, config, stages=("pretrain",))
    counters = json.loads((out / "manifest.json").read_text())["counters"]
    assert counters["resumed_from_step"] == 14 and counters["train.qat.steps"] == ref_counters["train.qat.steps"] == 4
    strip = lambda rows: [{k: v for k, v in json.loads(r).items() if k != "tokens_per_s"} for r in rows.splitlines()]
    assert strip((out / "metrics.jsonl").read_text()) == strip(reference["metrics.jsonl"].decode())
    assert (out / "model.safetensors").read_bytes() == reference["model.safetensors"]


@pytest.mark.slow
def test_compiled_regions_train_and_evaluate_through_the_rung(one_thread):
    """train.compile on (CPU inductor here): the regions read the shadowed weights, so their forward and gradients
    through the rung are the eager ones (~30 s of compiling)."""
    cfg = ModelConfig(d_model=64, n_heads=2, head_dim=32, ffn_hidden=96, n_core=2, kda_chunk_size=16)
    eager = live_model(cfg).train()
    compiled = copy.deepcopy(eager)
    assert compile_regions(compiled)
    x, y = rand_bytes(2, 32), rand_bytes(2, 32, seed=2)
    out = {}
    for name, m in (("eager", eager), ("compiled", compiled)):
        fq = FakeQuant(m, "ternary")
        for _ in range(2):  # a second step: the regions' guards hold across contexts
            with fq.applied():
                m(x, y, counters=Counter())[1].backward()
        with torch.no_grad(), fq.applied():
            out[name] = m.eval()(x)[0]
        with torch.no_grad():
            out[name + "_plain"] = m(x)[0]
    torch.testing.assert_close(out["compiled"], out["eager"], rtol=1e-5, atol=1e-5)
    assert (out["compiled"] - out["compiled_plain"]).abs().max() > 1e-4
    for (n, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.slow
def test_a_qat_chain_to_bench_scores_its_rungs_beside_its_ptq_twin(tmp_path, small_corpus, quality_examples):
    """train.qat, sft.qat and rl.qat on ternary through bench: every stage counts its steps through the rung, export
    marks ternary qat, and bench.json (schema-valid) holds rungs_ptq from the twin chain with qat off."""
    for d in ("config", "workflow"):
        shutil.copytree(ROOT / d, tmp_path / d)
    config = configure(tmp_path, small_corpus, *quality_examples)
    path = tmp_path / "config" / "presets" / "tiny.yaml"
    preset = yaml.safe_load(path.read_text())
    preset.update({
        "model": QAT_MODEL, "train": {**QAT_TRAIN, "steps": 12, "eval_every": 12, "ckpt_every": 12},
        "tasks": {"families": ["add", "reverse"], "difficulties": [1], "heldout_items": 2, "max_new_bytes": 8,
                  "sampled_eval": {"samples": 1}},
        "sft": {"steps": 3, "batch_size": 4, "log_every": 1, "replay_rows": 2, "replay_seq_len": 32, "qat": "ternary"},
        "rl": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "select": {"every": 1, "items_per_cell": 2},
               "qat": "ternary"},
        "export": {"rungs": ["bf16", "ternary"]},
        "bench": {"cloze": {"items": 2, "context_bytes": 16, "span_bytes": 4}},
    })
    path.write_text(yaml.safe_dump(preset, sort_keys=False))
    plan = run_chain(tmp_path, config, stages=("filter", "shard", "anchors", "pretrain", "sft", "rl", "export"))
    twin = plan.chain["tiny/ptq"]
    assert set(twin) == {"filter", "shard", "anchors", "pretrain", "sft", "rl", "export"}
    assert twin["shard"] == plan.chain["tiny"]["shard"] and twin["pretrain"] != plan.chain["tiny"]["pretrain"]
    assert plan.job("bench", plan.chain["tiny"]["bench"]).inputs["export_ptq"]["digest"] == twin["export"]
    run_chain(tmp_path, config, "tiny/ptq", stages=("pretrain", "sft", "rl", "export"))
    run_chain(tmp_path, config, stages=("bench",))
    manifests = {s: json.loads((tmp_path / plan.manifest_path(s, plan.chain["tiny"][s])).read_text())
                 for s in ("pretrain", "sft", "rl", "export")}
    assert manifests["pretrain"]["counters"]["train.qat.steps"] == 3
    assert manifests["sft"]["counters"]["train.qat.steps"] == 3 and manifests["rl"]["counters"]["train.qat.steps"] == 2
    for s in ("sft", "rl"):
        assert manifests[s]["counters"]["qat.tensors_moved"] == manifests[s]["counters"]["qat.tensors.ternary"] > 0
    assert [q["stage"] for q in manifests["export"]["final"]["qat"]] == ["pretrain", "sft", "rl"]
    ptq = json.loads((tmp_path / plan.manifest_path("export", twin["export"])).read_text())["final"]
    assert "qat" not in ptq and all("method" not in r for r in ptq["rungs"].values())

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        art = plan.artifact_dir("bench", plan.chain["tiny"]["bench"])
        assert view_main(["bench", "--preset", "tiny", "--artifact", art, "--out", "results/tiny/bench.json"]) == 0
        bench = json.loads(Path("results/tiny/bench.json").read_text())
    finally:
        os.chdir(cwd)
    validate(bench, "bench.schema.yaml", "bench.json")
    assert {r: v["method"] for r, v in bench["rungs"].items()} == {"bf16": "ptq", "ternary": "qat"}
    assert set(bench["rungs_ptq"]) == {"bf16", "ternary"} and bench["rungs_ptq"]["ternary"]["bpb"] == ptq["rungs"]["ternary"]["bpb"]
    assert bench["rungs"]["ternary"]["bpb"] == manifests["export"]["final"]["rungs"]["ternary"]["bpb"]
    assert twin["export"] in {link["digest"] for link in bench["digest_chain"]}  # the twin is in the chain it rests on
    # the QAT rung and the PTQ rung, each against its own bf16, item by item
    assert set(bench["paired"]["rungs_vs_bf16"]) == set(bench["paired"]["rungs_ptq_vs_bf16"]) == {"ternary"}
    # #28's bar: every rung of the QAT chain against the twin's bf16, the bf16 model of the same budget
    twin_bf16 = bench["paired"]["rungs_vs_twin_bf16"]
    assert set(twin_bf16) == {"bf16", "ternary"}
    for rung, p in twin_bf16.items():
        got = bench["rungs"][rung]["tasks_gen"]["correct"] - bench["rungs_ptq"]["bf16"]["tasks_gen"]["correct"]
        assert p["delta_accuracy"] == round(got / p["n"], 5) and p["within_one_se"] == (abs(got / p["n"]) <= p["se_base"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rung", QAT_RUNGS)
def test_on_cuda_the_quantized_weights_are_the_cpu_rung_file_and_a_finish_step_trains(rung):
    """The GPU computes QAT's weights (frexp, the e8m0 and e4m3 casts on the device) exactly as export's CPU file,
    and a step through the rung moves the fp32 masters on the device."""
    g = torch.Generator().manual_seed(0)
    for W in (torch.randn(96, 256, generator=g), torch.randn(4, 64, 96, generator=g) * torch.tensor([0.01, 1, 30, 1e-4])[:, None, None]):
        cpu = quant.dequantize(rung, quant.quantize(rung, W), W.shape)
        assert torch.equal(quant.fake_quant(rung, W.cuda()).cpu(), cpu), rung
    model = live_model(CFG).cuda().train()
    fq = FakeQuant(model, rung)
    before = {n: model.get_parameter(n).detach().clone() for n in fq.quantized}
    opts = build_optimizers(model, OptimSettings.of(TRAIN))
    x, y = rand_bytes(2, 64).cuda(), rand_bytes(2, 64, seed=2).cuda()
    with fq.applied(), torch.autocast("cuda", torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    for opt in opts:
        opt.step()
    assert torch.isfinite(loss) and fq.moved() == len(fq.quantized) > 0
    assert all(model.get_parameter(n).dtype == torch.float32 and not torch.equal(model.get_parameter(n), before[n])
               for n in fq.quantized)
