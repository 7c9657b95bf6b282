"""The byte-level language model: byte embedding -> prelude -> looped core -> coda -> RMSNorm -> head.

Block (pre-norm residual; `position` is the block's index among the n_blocks distinct blocks):
    x = x + engram(x, bytes)            only at positions in cfg.engram_layers (when cfg.engram)
    x = x + mixer(rmsnorm(x))           KDAMixer
    x = x + ffn(rmsnorm(x))             SwiGLU, or the dropless top-k MoE (cfg.moe)

Stack: blocks[0 : n_prelude] once, then the n_core core blocks (ONE set of weights) n_loop times, each
iteration's output feeding the next, then blocks[n_prelude + n_core :] once. An Engram (or any module)
attached to a core block runs on every iteration with the same weights. `engram_layers` indexes the
distinct blocks, 0 .. n_blocks - 1 (prelude, core, coda in that order).

`ByteLM.forward(idx, targets=None, counters=None) -> (logits, loss)`:
- idx [B, T] int bytes; logits [B, T, vocab] fp32 always (the head runs with autocast off in fp32);
- loss: mean next-byte cross entropy in nats over targets != -1 (None without targets). It does NOT
  include the MoE auxiliary loss: after every forward `model.aux_loss` holds the load-balancing loss
  averaged over the MoE applications of that forward (1.0 = perfectly balanced; a zero tensor without
  MoE); the trainer adds `coef * model.aux_loss` itself (0.01 is the usual coefficient).
- counters (a collections.Counter, optional): `loop.iterations += n_loop`, and the arms' own counters
  (`kda_path.*` and `kda_gates.*` per mixer call, `conv_path.*` per short conv, `moe.tokens.expert_{i}`, `engram.rows_read`).
  The MoE's routing counts reach `counters` at the end of the forward (one host read), or, in training mode
  with `model.defer_routing = True` (the pretrain loop, CUDA graphs), only when `take_routing(counters)` is called.

Decoding (`dormouse.posttrain.decode` builds on these): `prefill(idx, state=None) -> (logits, LMState)` runs a prompt (or
continues a state), `step(byte [B], state) -> (logits [B, vocab], LMState)` one byte per row. `LMState` holds
one `BlockState(mixer: KDAState, engram: EngramState | None)` per APPLIED block (schedule order; a looped
core block has one per iteration), all batch-first with sizes independent of the bytes consumed;
`state.select(rows)`, `state.repeat_interleave(g)` and `cat_states([...])` index / repeat / join batches.
The training forward ignores the state (it computes it and drops it: a few slices).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .engram import Engram, EngramState, engram_conv_size, engram_tables
from .ffn import MoE, SwiGLU, take_routing
from .kda import KDAMixer, KDAState


def _validate(cfg: ModelConfig) -> None:
    if min(cfg.n_prelude, cfg.n_core, cfg.n_coda) < 0 or cfg.n_loop < 1 or cfg.n_blocks < 1:
        raise ValueError(f"bad stack: n_prelude={cfg.n_prelude} n_core={cfg.n_core} n_loop={cfg.n_loop} "
                         f"n_coda={cfg.n_coda} (need n_loop >= 1 and at least one block)")
    if cfg.engram:
        bad = [p for p in cfg.engram_layers if not 0 <= p < cfg.n_blocks]
        if bad or not cfg.engram_layers or len(set(cfg.engram_layers)) != len(cfg.engram_layers):
            raise ValueError(f"engram_layers {cfg.engram_layers} must be distinct block positions in "
                             f"[0, n_blocks={cfg.n_blocks})")


# -------------------------------------------------------------------------------------------------
# Inference state: what continuing a sequence needs, one entry per APPLIED block
# -------------------------------------------------------------------------------------------------
class BlockState(NamedTuple):
    mixer: KDAState  # short-conv inputs [B, W-1, HK] x3 (None when kda_conv_size = 0), recurrent fp32 [B, H, K, V]
    engram: EngramState | None  # last bytes [B, max_order-1], bytes seen [B], conv history; None: no Engram


def _map(fn, tree):
    """fn on every tensor of a state (NamedTuples / tuples of tensors or None), keeping the structure."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if tree is None:
        return None
    parts = [_map(fn, t) for t in tree]
    return type(tree)(*parts) if hasattr(tree, "_fields") else type(tree)(parts)


def _zip_map(fn, trees):
    """fn on the list of corresponding tensors of several states of one structure."""
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return fn(list(trees))
    if first is None:
        return None
    parts = [_zip_map(fn, [t[i] for t in trees]) for i in range(len(first))]
    return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)


class LMState(NamedTuple):
    """`ByteLM`'s inference state: blocks[j] belongs to the j-th block of `schedule` (a core block looped n_loop
    times has n_loop entries: shared weights, separate states). Every tensor is batch-first and its size is
    fixed by the config, never by the number of bytes consumed, so a decode step costs the same at any depth."""

    blocks: tuple[BlockState, ...]

    @property
    def batch_size(self) -> int:
        return self.blocks[0].mixer.recurrent.shape[0]

    def select(self, rows: torch.Tensor | list[int]) -> LMState:
        """The rows `rows` of the batch (a list or LongTensor of indices, in that order, or a BoolTensor mask)."""
        if not isinstance(rows, torch.Tensor):
            rows = torch.tensor(list(rows), dtype=torch.long)
        return _map(lambda t: t[rows.to(t.device)], self)

    def repeat_interleave(self, repeats: int) -> LMState:
        """Each row `repeats` times in a row (G samples per prompt: rows [p0]*G + [p1]*G + ...)."""
        return _map(lambda t: t.repeat_interleave(repeats, dim=0), self)

    def map(self, fn) -> LMState:
        """fn on every tensor, the structure kept (views of a static buffer's rows, buffers shaped like a state)."""
        return _map(fn, self)

    def tensors(self) -> list[torch.Tensor]:
        out = []
        _map(out.append, self)
        return out

    def row_bytes(self) -> int:
        """Bytes of one row's state (every tensor's first row): what a stream or a decoded reply holds."""
        return sum(t[:1].numel() * t.element_size() for t in self.tensors())


def cat_states(states: list[LMState]) -> LMState:
    """Concatenate states of one model along the batch (rows of states[0] first)."""
    return _zip_map(lambda ts: torch.cat(ts, 0), states)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, position: int):
        super().__init__()
        self.position = position
        self.engram = Engram(cfg, position) if cfg.engram and position in cfg.engram_layers else None
        self.mixer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = KDAMixer(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = (MoE(cfg.d_model, cfg.ffn_hidden, cfg.n_experts, cfg.moe_top_k) if cfg.moe
                    else SwiGLU(cfg.d_model, cfg.ffn_hidden))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, counters: Counter | None = None) -> torch.Tensor:
        return self.forward_state(x, idx, None, counters)[0]

    def forward_state(self, x: torch.Tensor, idx: torch.Tensor, state: BlockState | None,
                      counters: Counter | None = None) -> tuple[torch.Tensor, BlockState]:
        """The block continuing `state` (None = sequence start); returns (x, the state after idx)."""
        engram_state = None
        if self.engram is not None:
            e, engram_state = self.engram(x, idx, counters, None if state is None else state.engram)
            x = x + e
        y, mixer_state = self.mixer(x, counters=counters, state=None if state is None else state.mixer,
                                    norm=self.mixer_norm)  # the norm runs inside the mixer's in_proj region
        x = self.mix_ffn(x, y)
        if isinstance(self.ffn, MoE):
            x = x + self.ffn(self.ffn_norm(x), counters)
        return x, BlockState(mixer_state, engram_state)

    def mix_ffn(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + the mixer's output, then a dense FFN's residual branch (a torch.compile region; an MoE
        runs outside it: it syncs on its routing and counts tokens)."""
        x = x + y
        return x if isinstance(self.ffn, MoE) else x + self.ffn(self.ffn_norm(x))

    def regions(self) -> tuple[str, ...]:
        return ("mix_ffn",)

    def output_projections(self) -> list[torch.Tensor]:
        """The weight of the last linear of every residual branch of this block (zero at init)."""
        outs = [self.mixer.o_proj.weight, *self.ffn.output_projections()]
        if self.engram is not None:
            outs += self.engram.output_projections()
        return outs


class ByteLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _validate(cfg)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_blocks))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.aux_loss: torch.Tensor | None = None
        self.defer_routing = False  # see the module docstring
        self.init_weights()

    # ---------------------------------------------------------------------------------------------
    @property
    def schedule(self) -> list[int]:
        """Block indices in the order one forward applies them (length cfg.depth)."""
        c = self.cfg
        core = list(range(c.n_prelude, c.n_prelude + c.n_core))
        return list(range(c.n_prelude)) + core * c.n_loop + list(range(c.n_prelude + c.n_core, c.n_blocks))

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                counters: Counter | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, _ = self.prefill(idx, None, counters)
        return logits, None if targets is None else self.loss(logits, targets)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head (a torch.compile region): the residual stream [B, T, D] -> fp32 logits."""
        x = self.norm(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.float(), self.head_weight.float())  # fp32 logits whatever the autocast

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross entropy in nats; targets -1 are ignored."""
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)

    def regions(self) -> tuple[str, ...]:
        return ("logits",)

    def prefill(self, idx: torch.Tensor, state: LMState | None = None,
                counters: Counter | None = None) -> tuple[torch.Tensor, LMState]:
        """idx [B, T] continuing `state` (None = sequence start) -> (logits [B, T, vocab] fp32, the state after idx).
        prefill(a ++ b) == prefill(b, prefill(a)[1]) (same logits for b, same state) up to fp rounding.
        T > 1 runs the chunked KDA, T == 1 the recurrence. Does not turn off autograd: wrap it as you need."""
        applied = self.schedule
        if state is not None and len(state.blocks) != len(applied):
            raise ValueError(f"state has {len(state.blocks)} block states, the schedule applies {len(applied)}")
        x = self.embed(idx)
        aux, new = [], []
        for j, i in enumerate(applied):
            block = self.blocks[i]
            x, st = block.forward_state(x, idx, None if state is None else state.blocks[j], counters)
            new.append(st)
            if isinstance(block.ffn, MoE):
                aux.append(block.ffn.aux_loss)
        logits = self.logits(x)
        self.aux_loss = torch.stack(aux).mean() if aux else torch.zeros((), device=x.device)
        if counters is not None:
            counters["loop.iterations"] += self.cfg.n_loop
            if not (self.training and self.defer_routing):
                self.take_routing(counters)
        return logits, LMState(tuple(new))

    def take_routing(self, counters: Counter | None) -> None:
        """The MoE routing counted since the last call into `counters` (None: dropped); nothing without MoE."""
        take_routing((b.ffn for b in self.blocks if isinstance(b.ffn, MoE)), counters)

    def step(self, byte: torch.Tensor, state: LMState | None,
             counters: Counter | None = None) -> tuple[torch.Tensor, LMState]:
        """One byte per row, byte [B] -> (logits of the next byte [B, vocab] fp32, the new state)."""
        logits, state = self.prefill(byte.reshape(-1, 1), state, counters)
        return logits[:, 0], state

    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """How every parameter starts (asserts that none is left out):
        - byte embedding, head (when untied), every nn.Linear outside the mixers (FFN projections, MoE
          router, Engram key/value projections) and every expert matrix of an MoE bank: normal(0, init_std);
        - Engram tables: normal(0, init_std) (one row per n-gram, like the byte embedding);
        - every RMSNorm gain: ones;
        - the KDA mixer: its own `reset_parameters()` (normal(0, init_std) linears, zero biases, torch's
          default conv init, FLA's A_log ~ log U(1, 16), dt_bias 0, output-norm gain 1) — not overridden;
        - then the output projection of every residual branch (mixer o_proj, SwiGLU / expert w_down,
          Engram value_proj) and the Engram short conv are ZEROED (as modded-nanogpt / nanochat): each
          block starts as the identity, the stack as embedding -> norm -> head, and the branches grow
          from there (gradients reach the zeroed weights at step 0 and everything else from step 1).
        Consequence for tests: a fresh model's blocks are inert; perturb the weights before probing them.
        """
        std = self.cfg.init_std
        done: set[int] = set()

        def mark(*ps):
            done.update(id(p) for p in ps if p is not None)

        for m in self.modules():
            if isinstance(m, KDAMixer):
                m.reset_parameters()
                mark(*m.parameters())
        for name, m in self.named_modules():
            if isinstance(m, KDAMixer) or ".mixer." in f".{name}.":
                continue
            if isinstance(m, MoE):  # the router first, then each expert's matrices: the order of nn.Linear experts
                nn.init.normal_(m.router.weight, std=std)
                m.reset_experts(lambda w: nn.init.normal_(w, std=std))
                mark(m.router.weight, m.w_gate, m.w_up, m.w_down)
            elif id(getattr(m, "weight", None)) in done:
                continue
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                mark(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
                    mark(m.bias)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
                mark(m.weight)
            elif isinstance(m, nn.Conv1d):  # the Engram short conv (see above)
                nn.init.zeros_(m.weight)
                mark(m.weight)
        for block in self.blocks:
            for proj in block.output_projections():
                nn.init.zeros_(proj)
        missed = [n for n, p in self.named_parameters() if id(p) not in done]
        assert not missed, f"init_weights does not say how these start: {missed}"

    def param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(hidden_matrices, other) for Muon / AdamW; every parameter is in exactly one list.

        hidden_matrices: the 2-D weight of every nn.Linear inside a block (KDA q/k/v/f/g/b/o projections,
        SwiGLU projections, Engram key/value projections) except the MoE router, and the MoE's 3-D expert
        banks (E matrices each: dormouse/train/optim.py's StackedMuon orthogonalises each matrix on its own).
        other: byte embedding, head, all RMSNorm gains, biases, Engram tables, conv weights (3-D),
        A_log, dt_bias, the mixers' output-norm gain, the MoE routers.
        """
        hidden_ids: set[int] = set()
        for block in self.blocks:
            routers = {id(block.ffn.router.weight)} if isinstance(block.ffn, MoE) else set()
            for m in block.modules():
                if isinstance(m, nn.Linear) and m.weight.dim() == 2 and id(m.weight) not in routers:
                    hidden_ids.add(id(m.weight))
                elif isinstance(m, MoE):
                    hidden_ids.update(id(b) for b in (m.w_gate, m.w_up, m.w_down))
        params = list(self.parameters())  # deduplicated (a tied head is the embedding)
        hidden = [p for p in params if id(p) in hidden_ids]
        other = [p for p in params if id(p) not in hidden_ids]
        assert len(hidden) + len(other) == len(params) and {id(p) for p in hidden} | {id(p) for p in other} == {
            id(p) for p in params}
        assert all(p.dim() in (2, 3) for p in hidden)
        return hidden, other


# -------------------------------------------------------------------------------------------------
# Closed-form parameter counts (mirror the modules above and KDAMixer; tested against the model)
# -------------------------------------------------------------------------------------------------
def kda_params(cfg: ModelConfig) -> int:
    """KDAMixer: q/k/v (D x HK each), 3 depthwise convs (HK x W), f_proj (D x K, K x HK), b_proj (D x H),
    A_log (H), dt_bias (HK), g_proj (D x K, K x HK + bias HK), output-norm gain (K), o_proj (HK x D)."""
    d, h, k, w = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.kda_conv_size
    hk = h * k
    return (3 * d * hk + (3 * hk * w if w > 0 else 0) + (d * k + k * hk) + d * h + h + hk
            + (d * k + k * hk + hk) + k + hk * d)


def kda_matmul_params(cfg: ModelConfig) -> int:
    """The nn.Linear weights of one KDAMixer (what a token multiplies)."""
    d, h, k = cfg.d_model, cfg.n_heads, cfg.head_dim
    hk = h * k
    return 3 * d * hk + 2 * (d * k + k * hk) + d * h + hk * d


def engram_params(cfg: ModelConfig) -> dict[str, int]:
    specs = engram_tables(cfg)
    d, mem, wc = cfg.d_model, len(specs) * cfg.engram_dim, engram_conv_size(cfg)
    tables = sum(s.rows for s in specs) * cfg.engram_dim
    proj = 2 * mem * d
    rest = 2 * d + ((d + d * wc) if wc > 0 else 0)  # key/query norms; conv norm + depthwise conv
    return {"tables": tables, "proj": proj, "total": tables + proj + rest, "n_tables": len(specs)}


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the config alone.

    total: == sum(p.numel() for p in ByteLM(cfg).parameters()).
    active: total with only moe_top_k of the n_experts expert banks per block (what one token touches;
        Engram tables count in full).
    non_embedding: total minus the byte embedding, the head and the Engram tables.
    flop_params: nn.Linear weights one token multiplies per forward: the head plus, for every APPLIED
        block (core blocks n_loop times), its mixer / FFN (router + top_k experts) / Engram projections.
        Forward FLOPs/token ~ 2 * flop_params (plus KDA's state recurrence and the conv/lookups).
    """
    d, v, f = cfg.d_model, cfg.vocab_size, cfg.ffn_hidden
    swiglu = 3 * d * f
    if cfg.moe:
        ffn, ffn_active = cfg.n_experts * swiglu + d * cfg.n_experts, cfg.moe_top_k * swiglu + d * cfg.n_experts
    else:
        ffn = ffn_active = swiglu
    eg = engram_params(cfg) if cfg.engram else {"tables": 0, "proj": 0, "total": 0}
    engram_pos = set(cfg.engram_layers) if cfg.engram else set()
    mixer = kda_params(cfg)
    block = 2 * d + mixer + ffn
    embedding, head = v * d, (0 if cfg.tie_embeddings else v * d)
    blocks = cfg.n_blocks * block + len(engram_pos) * eg["total"]
    total = embedding + head + d + blocks
    active = total - cfg.n_blocks * (ffn - ffn_active)
    core = range(cfg.n_prelude, cfg.n_prelude + cfg.n_core)
    applied = [cfg.n_loop if p in core else 1 for p in range(cfg.n_blocks)]
    per_block_mm = kda_matmul_params(cfg) + ffn_active
    flop = v * d + sum(a * (per_block_mm + (eg["proj"] if p in engram_pos else 0)) for p, a in enumerate(applied))
    return {
        "embedding": embedding,
        "head": head,
        "mixer_per_block": mixer,
        "ffn_per_block": ffn,
        "engram_per_layer": eg["total"],
        "engram_tables": len(engram_pos) * eg["tables"],
        "total": total,
        "active": active,
        "non_embedding": total - embedding - head - len(engram_pos) * eg["tables"],
        "flop_params": flop,
    }


def active_params(cfg: ModelConfig) -> int:
    return count_params(cfg)["active"]
