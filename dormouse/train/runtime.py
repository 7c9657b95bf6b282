"""What every model-running stage shares: the device rule, autocast, BPB on the eval window, the
arm checks and loading a trained model back from its artifact. One definition of BPB lives here."""

from __future__ import annotations

import json
import math
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch

from dormouse.model.config import ModelConfig
from dormouse.train import checkpoint
from dormouse.train.arms import inert_arms

LN2 = math.log(2)


def device_for(device: str, stage: str = "pretrain") -> torch.device:
    """train.device as a torch device; cuda with none visible is an error (no silent CPU fallback)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{stage}: the preset asks for device cuda and none is visible (no silent CPU fallback)")
    return torch.device(device)


def uses_bf16(dtype: str) -> bool:
    """Whether the run computes in bf16 on CUDA (train.dtype): `autocast` below, and `decode.generate`'s `bf16`."""
    return dtype == "bfloat16"


def autocast(device: torch.device, dtype: str, cache: bool = True):
    """bf16 autocast on CUDA (train.dtype); cache=False inside a CUDA graph capture (dormouse.train.cuda_graphs)."""
    if device.type == "cuda" and uses_bf16(dtype):
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)
    return nullcontext()


def compile_for(model: torch.nn.Module, device: torch.device, mode: str) -> list[str]:
    """train.compile: "cuda" compiles the model's regions (dormouse.model.regions) on a GPU, where the eager
    step is launch-bound; "always" on any device; "never" leaves it eager. Returns the regions compiled."""
    from dormouse.model.regions import compile_regions

    if mode == "always" or (mode == "cuda" and device.type == "cuda"):
        return compile_regions(model)
    return []


def deterministic_cpu(device: torch.device) -> None:
    """Bit-reproducible CPU runs: multi-threaded CPU kernels gave different last bits run to run
    (measured), so intra-op parallelism is off on CPU."""
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)


def pad_width(width: int, device: torch.device) -> int:
    """Right-padded batch width: a multiple of FLA's chunk (64) on CUDA, so variable-length batches
    reuse a few kernel shapes (Triton autotunes per shape); exact on CPU."""
    return -(-width // 64) * 64 if torch.device(device).type == "cuda" else width


def bits_per_byte(nats: float, n_bytes: int) -> float:
    return nats / LN2 / n_bytes


@torch.no_grad()
def evaluate(model, x, y, batch_size: int, device: torch.device, dtype: str, counters) -> float:
    """Bits per byte over the fixed window (rewound every call), in eval mode without autograd; dtype: train.dtype."""
    was_training = model.training
    model.eval()
    nats = 0.0
    for i in range(0, len(x), batch_size):
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        with autocast(device, dtype):
            logits, _ = model(xb, counters=counters)
        nats += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="sum").item()
    model.train(was_training)
    return bits_per_byte(nats, y.numel())



def with_moe_aux(loss: torch.Tensor, model, cfg: ModelConfig, coef: float | None) -> torch.Tensor:
    """loss plus `coef * model.aux_loss` (the balancing loss of the last forward) for an MoE model; loss otherwise.
    sft and rl take coef from their params, which carry pretrain's train.moe_aux_coef exactly when the model is an MoE."""
    if not cfg.moe:
        return loss
    if coef is None:
        raise SystemExit("the model is an MoE but the job has no moe_aux_coef: plan it again")
    return loss + coef * model.aux_loss

def check_arms_active(cfg: ModelConfig, counters: Counter, where: str, stage: str = "pretrain") -> None:
    """An enabled arm that left no trace is a defect (a memory arm once got None in eval)."""
    problems = inert_arms(cfg, counters)
    if problems:
        raise SystemExit(f"{stage}: {where}: {'; '.join(problems)} (counters: {dict(counters)})")


def checked_counters(c, cfg: ModelConfig, train_counters: Counter, eval_counters: Counter, stage: str,
                     trained: bool = True) -> None:
    """Fail on an inert arm in training (when any training step ran) or eval, then file both counter sets
    into the manifest's."""
    if trained:
        check_arms_active(cfg, train_counters, "training", stage)
    check_arms_active(cfg, eval_counters, "eval", stage)
    for prefix, counters in (("train", train_counters), ("eval", eval_counters)):
        for k, v in counters.items():
            c[f"{prefix}.{k}"] = v


def update(loss: torch.Tensor, params: list, opts: list, grad_clip: float, stage: str, step: int) -> None:
    """One post-training update: a non-finite loss is a defect there (no firewall budget), then backward,
    clip, every optimizer's step and zero_grad."""
    if not torch.isfinite(loss):
        raise SystemExit(f"{stage}: non-finite loss at step {step}")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def save_model_artifact(art, model, config: dict, metrics: list[dict]) -> None:
    """What a training stage leaves: weights (safetensors), config.json and metrics.jsonl."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(art.path("model.safetensors")))
    art.path("config.json").write_text(json.dumps(config, indent=1))
    art.path("metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def device_facts(device: torch.device) -> dict:
    """The manifest's facts of where a run trained: the GPU and its peak memory (rank 0's), torch's CPU threads."""
    facts = {}
    if device.type == "cuda":
        facts["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        # reserved counts CUDA graphs' private pools, which the allocated peak may leave out
        facts["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
        facts["gpu"] = torch.cuda.get_device_name(device)
    return {**facts, "torch_threads": torch.get_num_threads()}


def model_config_of(art_dir: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((Path(art_dir) / "config.json").read_text())["model"])


def load_model(art, device: torch.device, weights: str = "model.safetensors"):
    """A stage's trained model back from its artifact (config.json + safetensors, strict keys)."""
    from dormouse.model.gpt import ByteLM

    cfg = ModelConfig.from_dict(json.loads(art.file("config.json").read_text())["model"])
    model = ByteLM(cfg)
    checkpoint.load_weights(model, art.file(weights), source=f"{art.path}/{weights}")
    return model.to(device), cfg
