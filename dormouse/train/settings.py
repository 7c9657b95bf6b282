"""The pretrain stage's settings as types: built once from the job's `train` section (a validated preset's, or the
digested params with their later defaults put back), then read as attributes below the stage, so a misspelt name
is an AttributeError on the CPU's first import-time use, not a KeyError in a GPU-only branch. The dicts stay what
is digested and written into config.json; these are read-only views of them. Torch-free: the planner reads them."""

from __future__ import annotations

from dataclasses import dataclass, fields

# Keys added to `train` after digests were pinned, with the default that runs the code as it was: at that value they
# stay out of the params (planner/registry.py), so adding them rebuilt nothing; the schema holds the same, tested.
TRAIN_LATER_DEFAULTS = {"qat": None, "micro_batch_size": None,  # quantization-aware finish (issue #28); accumulation
                        "ptq_rungs": [],  # the final weights' BPB through other rungs (a QAT experiment's control)
                        "keep_checkpoints": []}  # steps whose checkpoints the artifact keeps (a finish branches there)


def build_settings(cls, section: dict, where: str, strict: bool = True, **converted):
    """cls from `section`'s keys (`converted`: the fields given already typed); a missing key is named, and with
    `strict` an unknown one too (a section that carries more keys, e.g. rl's for OptimSettings, passes strict=False)."""
    names = [f.name for f in fields(cls)]
    missing = [n for n in names if n not in section and n not in converted]
    unknown = sorted(set(section) - set(names)) if strict else []
    if missing or unknown:
        raise KeyError(f"{where}: " + "; ".join(([f"no {', '.join(missing)}"] if missing else [])
                                                + ([f"unknown keys {unknown}"] if unknown else [])))
    return cls(**{n: converted[n] if n in converted else section[n] for n in names})


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimSettings:
    """What build_optimizers reads, from any training section (train, sft, rl)."""

    optimizer: str  # muon (hidden matrices) + AdamW (the rest), or adamw for all
    lr: float  # AdamW's
    muon_lr: float
    weight_decay: float

    @classmethod
    def of(cls, section: dict, where: str = "optimizer") -> OptimSettings:
        return build_settings(cls, section, where, strict=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class QATFinish:
    """train.qat: the last `fraction` of the steps train through `rung`'s export forward."""

    rung: str
    fraction: float

    @classmethod
    def of(cls, spec: dict | None) -> QATFinish | None:
        return None if spec is None else cls(rung=spec["rung"], fraction=spec["fraction"])


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSettings:
    """preset.schema.yaml's `train`, one field per key (its descriptions say what each does)."""

    device: str
    dtype: str
    compile: str
    cuda_graphs: str
    seed: int
    steps: int
    batch_size: int
    micro_batch_size: int | None
    seq_len: int
    max_epochs: float | None
    optimizer: str
    lr: float
    muon_lr: float
    weight_decay: float
    warmup_steps: int
    decay_frac: float
    min_lr_frac: float
    grad_clip: float
    max_bad_steps: int
    moe_aux_coef: float
    eval_every: int
    eval_bytes: int
    ckpt_every: int
    log_every: int
    qat: QATFinish | None
    keep_checkpoints: tuple[int, ...]
    ptq_rungs: tuple[str, ...]

    @classmethod
    def of(cls, section: dict) -> TrainSettings:
        """From a job's train params (keys at their later default are absent there) or a resolved preset's section."""
        full = {**TRAIN_LATER_DEFAULTS, **section}
        return build_settings(cls, full, "train", qat=QATFinish.of(full["qat"]),
                      keep_checkpoints=tuple(full["keep_checkpoints"] or ()), ptq_rungs=tuple(full["ptq_rungs"] or ()))

    @property
    def optim(self) -> OptimSettings:
        return OptimSettings(optimizer=self.optimizer, lr=self.lr, muon_lr=self.muon_lr, weight_decay=self.weight_decay)
