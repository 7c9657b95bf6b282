"""Weight quantizers for the export rungs: bf16, int8, fp8, mxfp4, nvfp4, ternary.

A quantized rung takes a 2-D matrix W [out, in] (rows = output channels; blocks and per-channel
scales run along `in`) and returns named tensors; `dequantize` gives back fp32 of the original
shape. Storage layout (`quantize(rung, W)`; in a file each part is stored as `<param>::<part>`):

  rung     parts: dtype [shape]                                      W ~=
  bf16     w: bfloat16 [any]                                         w
  int8     q: int8 [out, in], scale: fp32 [out]                      q * scale[:, None]
  fp8      q: float8_e4m3fn [out, in], scale: fp32 [out]             q * scale[:, None]
  mxfp4    q: uint8 [out, P/2], scale: uint8 [out, P/32]             e2m1(q) * 2^(scale - 127)  (E8M0)
  nvfp4    q: uint8 [out, P/2], block_scale: float8_e4m3fn           e2m1(q) * block_scale * tensor_scale
           [out, P/16], tensor_scale: fp32 []
  ternary  q: uint8 [ceil(out*in/4)], scale: fp32 []                 (code - 1) * scale

- A 3-D bank [E, out, in] (an MoE's experts) is E matrices quantized each on its own, exactly as separate
  2-D parameters would be; every part gets a leading E (e.g. int8 q [E, out, in], scale [E, out]; ternary's
  tensor scale [E]).
- P = `in` zero-padded up to the block size (32 mxfp4, 16 nvfp4); `dequantize` crops the padding.
- FP4 codes are E2M1 nibbles: sign bit 3, exponent bits 2..1, mantissa bit 0 (the ml_dtypes
  float4_e2m1fn bit patterns); two per byte along `in`, element 2j in the LOW nibble, 2j+1 high.
- Ternary codes are q + 1 in {0, 1, 2} (3 unused), four per byte over the row-major flattened
  matrix, element 4j+i in bits 2i..2i+1; the tail pads with code 1 (zero).

What the block rules give the block max (tests pin both):
- mxfp4 (OCP MX v1.0 sec. 6.3): scale 2^(floor(log2 amax) - 2), so amax / scale = 4m for amax = m*2^k,
  m in [1, 2): m <= 1.25 -> 4 (5 ties to 4), m in (1.25, 1.5] -> 6 by rounding, m > 1.5 -> clamped
  to 6 (up to 25% low). The max lands exactly on 6 only when amax is 6 times a power of two.
- nvfp4: the ideal block scale amax/6/tensor_scale rounds to e4m3 with relative error <= 2^-4 when
  it is an e4m3 normal (>= 2^-6), so the max lands in [6/(1+2^-4), 6/(1-2^-4)] = [5.65, 6.4] and
  always quantizes to 6; dequantized it is within amax/16 of amax. A subnormal block scale (block amax
  below 2^-6/448 ~ 2^-14.8 of the tensor's) gives no such promise, and one that rounds to 0 (block
  amax <= 2^-10/448 of the tensor's) zeroes the block.
Zero rows / blocks / tensors quantize to zero codes with finite scales (no NaN/inf).

Every codec is torch arithmetic on the weight's own device with no host sync, so `fake_quant` (what a rung
file's dequantized tensor holds, computed where the weights live) is the forward quantization-aware training
sees (dormouse/train/qat.py), with export's own definition: one set of quantizers for both. `quantize` adds
export's checks and moves the weights to CPU; tests/test_quant.py checks the E2M1 codec against ml_dtypes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

RUNGS = ("bf16", "int8", "fp8", "mxfp4", "nvfp4", "ternary")
RECIPE_KEY = "dormouse.model.quant.recipe"  # safetensors metadata key holding the recipe JSON
RECIPE_FORMAT = 1
SEP = "::"  # "<param>::<part>" in a rung file; no module path contains it

MX_BLOCK = 32  # OCP MX v1.0: k = 32 for every concrete MX format
NV_BLOCK = 16  # NVFP4 (NVIDIA Blackwell): 16 elements per E4M3 block scale
BLOCK = {"mxfp4": MX_BLOCK, "nvfp4": NV_BLOCK}
E2M1_MAX = 6.0
E2M1_EMAX = 2  # OCP MX v1.0 table 1: emax_elem of FP4 E2M1
E4M3_MAX = 448.0
E8M0_BIAS = 127  # E8M0 code c means 2^(c - 127); 255 is NaN and never written
INT8_MAX = 127  # symmetric: -128 unused
TERNARY_EPS = 1e-5  # BitNet b1.58 reference code clamps mean|W| at 1e-5; we add it (gamma + eps)

# One line per rule, copied into every recipe that uses it.
RULES = {
    "bf16": "cast to bfloat16 (round to nearest even)",
    "int8": "per output channel: scale = absmax(row)/127, q = clamp(round(W/scale), -127, 127)",
    "fp8": "per output channel: scale = absmax(row)/448, q = float8_e4m3fn(W/scale) (RNE)",
    "mxfp4": "OCP MX v1.0: 32 along in, E2M1 (RNE, clamp +-6), E8M0 scale 2^(floor(log2 amax) - 2)",
    "nvfp4": "16 along in, E2M1 (RNE, clamp +-6), E4M3 block scale amax/6/tensor_scale, "
             "fp32 tensor_scale = amax(W)/(6*448)",
    "ternary": "BitNet b1.58 absmean: scale = mean|W| + 1e-5, q = clamp(round(W/scale), -1, 1)",
    "keep": "stored unchanged (not floating point)",
}

# Default eligibility: 2-D float matrices of at least this many weights. Smaller ones (KDA b_proj
# H x D, MoE routers) are a sliver of any model and their scales would cost a larger share.
MIN_QUANT_NUMEL = 4096
# Kept in bf16 whatever their size: lookup tables (byte embedding, Engram n-gram tables), the head
# (BitNet b1.58 and llama.cpp keep embeddings/head in higher precision), and MoE routers (their
# output is a discrete top-k choice). Name suffixes as in ByteLM.state_dict().
KEEP_BF16_SUFFIXES = ("embed.weight", "table.weight", "head.weight", "router.weight")


def default_eligible(name: str, tensor: torch.Tensor) -> bool:
    """2-D matrices and 3-D banks of matrices, judged by the size of one matrix."""
    return (tensor.dim() in (2, 3) and tensor.is_floating_point() and tensor.shape[-2:].numel() >= MIN_QUANT_NUMEL
            and not name.endswith(KEEP_BF16_SUFFIXES))


def eligible_for(rung: str, quantize_tables: bool = False, narrow: list[str] | None = None
                 ) -> Callable[[str, torch.Tensor], bool]:
    """The matrices a rung quantizes, for export and quantization-aware training alike: `default_eligible`, plus
    the Engram tables when `quantize_tables`; a matrix narrower than the rung's block stays bf16 (zero padding
    to the block would make it larger than bf16) and its name is appended to `narrow`."""
    def eligible(name: str, tensor: torch.Tensor) -> bool:
        if quantize_tables and name.endswith("engram.table.weight"):
            ok = tensor.dim() == 2 and tensor.is_floating_point()
        else:
            ok = default_eligible(name, tensor)
        if ok and tensor.shape[-1] < BLOCK.get(rung, 1):
            if narrow is not None:
                narrow.append(name)
            return False
        return ok
    return eligible


def tensor_rule(rung: str, name: str, tensor: torch.Tensor,
                eligible: Callable[[str, torch.Tensor], bool] = default_eligible) -> str:
    """What a rung file does with one state-dict tensor: "keep" (not floating point), the rung (an eligible
    matrix), else "bf16"."""
    if not tensor.is_floating_point():
        return "keep"
    return rung if rung != "bf16" and eligible(name, tensor) else "bf16"


# -------------------------------------------------------------------------------------------------
# Element codecs
# -------------------------------------------------------------------------------------------------
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> |value|


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8 0..15): round to nearest, ties to even, saturating at +-6; the sign bit is set
    for every negative input (a negative rounding to zero is -0, code 8), as ml_dtypes' float4_e2m1fn cast does."""
    # torch has no cast to float4 (float4_e2m1fn_x2 is storage only). The grid steps by 0.5 below 2, by 1 in
    # [2, 4) and by 2 in [4, 6]: in each segment an even multiple of the step is an even code, so torch.round's
    # half-to-even rounding of |x| / step is E2M1's ties-to-even.
    mag = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    k = torch.round(mag / step)  # the grid value is k * step
    code = torch.where(step == 0.5, k, torch.where(step == 1.0, k + 2, k + 4))  # 2 -> code 4, 4 -> code 6
    return (code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3))


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> fp32."""
    mags = torch.tensor(E2M1_MAGNITUDES, device=codes.device)
    table = torch.cat([mags, -mags])
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2k] uint8 codes < 16 -> [..., k]: element 2j low nibble, 2j+1 high (no library packs)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def pack_crumbs(codes: torch.Tensor) -> torch.Tensor:
    """[..., 4k] uint8 codes < 4 -> [..., k] bytes, element 4j+i in bits 2i..2i+1."""
    c = codes.view(*codes.shape[:-1], -1, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_crumbs(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([(packed >> s) & 0b11 for s in (0, 2, 4, 6)], dim=-1).flatten(-2)


def _pad_in(W: torch.Tensor, block: int) -> torch.Tensor:
    """[..., out, in] -> [..., out, in_padded / block, block], zero-padded along in."""
    return F.pad(W, (0, -W.shape[-1] % block)).view(*W.shape[:-1], -1, block)


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c correctly rounded on every device: CUDA divides by a Python scalar as a multiply by its fp32
    reciprocal, one ulp off the CPU's division in some scales (seen on the H200, session 17)."""
    return x / torch.full_like(x, c)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """A divisor: zero scales (all-zero rows / blocks) become 1, so their codes come out 0."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# -------------------------------------------------------------------------------------------------
# Rungs: quantize -> parts, dequantize(parts, shape) -> fp32
# -------------------------------------------------------------------------------------------------
# Each rung takes a matrix [out, in] or an MoE bank [E, out, in] at once: every scale is per row, per block or per
# matrix, so a bank's parts are its matrices' parts stacked, in one kernel per op rather than one per expert.
def _q_int8(W):
    scale = _div(W.abs().amax(dim=-1), INT8_MAX)  # (..., out)
    q = torch.round(W / _safe(scale)[..., None]).clamp(-INT8_MAX, INT8_MAX)
    return {"q": q.to(torch.int8), "scale": scale}


def _dq_int8(t, shape):
    return t["q"].float() * t["scale"][..., None]


def _q_fp8(W):
    scale = _div(W.abs().amax(dim=-1), E4M3_MAX)  # (..., out)
    x = (W / _safe(scale)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)  # clamp: casts differ on overflow
    return {"q": x.to(torch.float8_e4m3fn), "scale": scale}


def _dq_fp8(t, shape):
    return t["q"].float() * t["scale"][..., None]


def _e8m0_values(code: torch.Tensor) -> torch.Tensor:
    return code.view(torch.float8_e8m0fnu).float()  # 2^(code - 127); code 0 is 2^-127 (subnormal fp32)


def _q_mxfp4(W):
    blocks = _pad_in(W, MX_BLOCK)  # (..., out, nb, 32)
    amax = blocks.abs().amax(dim=-1)  # (..., out, nb)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1, exactly
    shared = torch.where(amax > 0, e - 1 - E2M1_EMAX, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    code = (shared + E8M0_BIAS).to(torch.uint8)
    elems = e2m1_codes(blocks / _e8m0_values(code)[..., None])  # power-of-two divide: exact
    return {"q": pack_nibbles(elems.flatten(-2)), "scale": code}


def _dq_mxfp4(t, shape):
    vals = e2m1_values(unpack_nibbles(t["q"])).view(*shape[:-1], -1, MX_BLOCK)
    return (vals * _e8m0_values(t["scale"])[..., None]).view(*shape[:-1], -1)[..., : shape[-1]]


def _q_nvfp4(W):
    blocks = _pad_in(W, NV_BLOCK)  # (..., out, nb, 16)
    tensor_scale = _div(W.abs().amax(dim=(-2, -1)), E2M1_MAX * E4M3_MAX)  # fp32 (...): one per matrix
    amax = blocks.abs().amax(dim=-1)  # (..., out, nb)
    ideal = (_div(amax, E2M1_MAX) / _safe(tensor_scale)[..., None, None]).clamp(max=E4M3_MAX)  # <= 448 but for fp32 rounding
    block_scale = ideal.to(torch.float8_e4m3fn)
    denom = block_scale.float() * tensor_scale[..., None, None]
    x = torch.where(denom[..., None] > 0, blocks / _safe(denom)[..., None], 0.0)
    return {"q": pack_nibbles(e2m1_codes(x).flatten(-2)), "block_scale": block_scale,
            "tensor_scale": tensor_scale}


def _dq_nvfp4(t, shape):
    vals = e2m1_values(unpack_nibbles(t["q"])).view(*shape[:-1], -1, NV_BLOCK)
    denom = t["block_scale"].float() * t["tensor_scale"][..., None, None]
    return (vals * denom[..., None]).view(*shape[:-1], -1)[..., : shape[-1]]


def _q_ternary(W):
    # mean |W| per matrix, summed in fp64: an fp32 sum's last bit depends on its order (CPU, CUDA, a bank or a matrix)
    n = W.shape[-2] * W.shape[-1]
    scale = (W.abs().sum(dim=(-2, -1), dtype=torch.float64) / n).float() + TERNARY_EPS  # fp32 (...)
    codes = (torch.round(W / scale[..., None, None]).clamp(-1, 1) + 1).to(torch.uint8).flatten(-2)
    codes = F.pad(codes, (0, -codes.shape[-1] % 4), value=1)
    return {"q": pack_crumbs(codes), "scale": scale}


def _dq_ternary(t, shape):
    n = shape[-2] * shape[-1]
    return (unpack_crumbs(t["q"])[..., :n].float() - 1).view(shape) * t["scale"][..., None, None]


_QUANT = {"int8": (_q_int8, _dq_int8), "fp8": (_q_fp8, _dq_fp8), "mxfp4": (_q_mxfp4, _dq_mxfp4),
          "nvfp4": (_q_nvfp4, _dq_nvfp4), "ternary": (_q_ternary, _dq_ternary)}
assert set(_QUANT) | {"bf16"} == set(RUNGS)


def _by_matrix(fn, W: torch.Tensor) -> dict[str, torch.Tensor]:
    """A bank on the CPU one matrix at a time: the same bits as the whole bank at once, ~3x faster for b1's banks
    (each matrix's temporaries stay in cache); a GPU takes the bank at once (one launch per op, not per expert)."""
    each = [fn(m) for m in W]
    return {k: torch.stack([p[k] for p in each]) for k in each[0]}


def _parts(rung: str, W: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parts of a fp32 matrix or bank on any device, unchecked: what `quantize` stores and `fake_quant` reads."""
    if rung == "bf16":
        return {"w": W.to(torch.bfloat16)}
    if W.dim() == 3 and W.device.type == "cpu":  # see _by_matrix
        return _by_matrix(lambda m: _QUANT[rung][0](m), W)
    return _QUANT[rung][0](W)  # a bank [E, out, in] at once: its matrices' parts, stacked


def _values(rung: str, tensors: dict[str, torch.Tensor], shape: tuple) -> torch.Tensor:
    if rung == "bf16":
        return tensors["w"].float().view(shape)
    if len(shape) == 3 and tensors[next(iter(tensors))].device.type == "cpu":
        return torch.stack([_QUANT[rung][1]({k: v[i] for k, v in tensors.items()}, shape[1:]) for i in range(shape[0])])
    return _QUANT[rung][1](tensors, shape).contiguous()


def _check_rung(rung: str, W: torch.Tensor | None = None) -> None:
    if rung not in RUNGS:
        raise ValueError(f"unknown rung {rung!r}; known: {RUNGS}")
    if W is not None and rung != "bf16" and (W.dim() not in (2, 3) or not W.is_floating_point()):
        raise ValueError(f"{rung} quantizes 2-D float matrices and 3-D banks of them, got {W.dtype} {tuple(W.shape)}")


def quantize(rung: str, W: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored parts of W under `rung` (layout in the module docstring), on CPU. bf16 takes any shape,
    the others a 2-D [out, in] matrix or a 3-D bank of them; W must be finite (NaN/inf weights are a training defect)."""
    _check_rung(rung, W)
    if rung == "bf16":
        return {"w": W.detach().to("cpu", torch.bfloat16, copy=True).contiguous()}
    W = W.detach().to("cpu", torch.float32).contiguous()
    if not torch.isfinite(W).all():
        raise ValueError(f"{rung}: weights hold NaN/inf")
    parts = _parts(rung, W)
    # a scale that overflowed from finite weights is refused, never written as NaN parts (no rung's can since
    # ternary's mean |W| sums in fp64: a guard against a future rung's)
    bad = [k for k, v in parts.items() if v.dtype in (torch.float32, torch.bfloat16) and not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"{rung}: non-finite {bad} from finite weights (max |W| {W.abs().max().item():.3g})")
    return parts


def dequantize(rung: str, tensors: dict[str, torch.Tensor], shape) -> torch.Tensor:
    """fp32 tensor of `shape` (the shape quantize saw) from the parts `quantize(rung, ...)` gave."""
    _check_rung(rung)
    return _values(rung, tensors, tuple(shape))


def fake_quant(rung: str, W: torch.Tensor) -> torch.Tensor:
    """dequantize(rung, quantize(rung, W), W.shape) computed in fp32 on W's device, without export's checks (a
    host sync each) and without grad: what the rung file export writes holds for W, the forward that
    quantization-aware training sees. A NaN weight gives NaN values (the training's firewall catches the loss)."""
    _check_rung(rung, W)
    with torch.no_grad():
        W = W.detach().float().contiguous()
        return _values(rung, _parts(rung, W), tuple(W.shape))


# -------------------------------------------------------------------------------------------------
# State dicts and files
# -------------------------------------------------------------------------------------------------
def quantize_state_dict(state_dict: dict[str, torch.Tensor], rung: str,
                        eligible: Callable[[str, torch.Tensor], bool] = default_eligible
                        ) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors named `<param>::<part>`, recipe). Eligible matrices get `rung`; every other float
    tensor bf16; non-float tensors (Engram hash constants) are kept as they are. The recipe lists
    each parameter's rule and shape, and the one-line text of every rule used."""
    if rung not in RUNGS:
        raise ValueError(f"unknown rung {rung!r}; known: {RUNGS}")
    tensors, entries = {}, {}
    for name, t in state_dict.items():
        if SEP in name:
            raise ValueError(f"parameter name {name!r} contains the part separator {SEP!r}")
        rule = tensor_rule(rung, name, t, eligible)
        parts = {"w": t.detach().to("cpu", copy=True).contiguous()} if rule == "keep" else quantize(rule, t)
        tensors.update({f"{name}{SEP}{part}": v for part, v in parts.items()})
        entries[name] = {"rule": rule, "shape": list(t.shape)}
    used = sorted({e["rule"] for e in entries.values()})
    recipe = {"format": RECIPE_FORMAT, "rung": rung, "rules": {r: RULES[r] for r in used}, "tensors": entries}
    return tensors, recipe


def dequantize_state_dict(tensors: dict[str, torch.Tensor], recipe: dict) -> dict[str, torch.Tensor]:
    """The state dict back: float tensors fp32, kept tensors as stored. Strict: a stored tensor that
    no recipe entry claims is an error."""
    if recipe.get("format") != RECIPE_FORMAT:
        raise ValueError(f"recipe format {recipe.get('format')!r}, this code reads {RECIPE_FORMAT}")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, part = key.rpartition(SEP)
        parts.setdefault(name, {})[part] = t
    unclaimed = sorted(set(parts) - set(recipe["tensors"]))
    if unclaimed:
        raise ValueError(f"stored tensors without a recipe entry: {unclaimed}")
    out = {}
    for name, entry in recipe["tensors"].items():
        if entry["rule"] == "keep":
            out[name] = parts[name]["w"]
        else:
            out[name] = dequantize(entry["rule"], parts[name], entry["shape"])
    return out


def save_rung(path: Path | str, state_dict: dict[str, torch.Tensor], rung: str,
              eligible: Callable[[str, torch.Tensor], bool] = default_eligible) -> dict:
    """Writes one safetensors file (atomically: .tmp then rename) with the recipe JSON in its
    metadata under RECIPE_KEY; returns the recipe."""
    path = Path(path)
    tensors, recipe = quantize_state_dict(state_dict, rung, eligible)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={RECIPE_KEY: json.dumps(recipe)})
    os.replace(tmp, path)
    return recipe


def read_rung(path: Path | str) -> tuple[dict[str, torch.Tensor], dict]:
    """(stored tensors, recipe) of a rung file."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if RECIPE_KEY not in meta:
            raise ValueError(f"{path}: no {RECIPE_KEY} in the safetensors metadata (not a rung file)")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, json.loads(meta[RECIPE_KEY])


def load_rung(path: Path | str) -> dict[str, torch.Tensor]:
    """A rung file back as a state dict (floats fp32), loadable into the model it came from."""
    return dequantize_state_dict(*read_rung(path))


def load_rung_model(path, cfg, device):
    """A runnable model from a rung file (dequantized to fp32, every key accounted for)."""
    from dormouse.model.gpt import ByteLM  # the model only where a rung is run, not to quantize

    model = ByteLM(cfg)
    model.load_state_dict(load_rung(path), strict=True)
    return model.to(device).eval()


def rung_source_state(model) -> dict[str, torch.Tensor]:
    """The state dict the rungs quantize: floating tensors in fp32 on CPU; integer buffers (the Engram hash
    multipliers reach 2^31, past float32's 24-bit mantissa) unchanged."""
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu() for k, v in model.state_dict().items()}
