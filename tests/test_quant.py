"""dormouse.model.quant against independent references: a brute-force E2M1 rounder, numpy/ml_dtypes
re-implementations of the MXFP4 and NVFP4 rules, ml_dtypes float8_e4m3fn / float8_e8m0fnu casts;
pinned ties; the block-max promises each block rule does (and does not) make; packing; odd shapes and
zero blocks; a model's state dict through safetensors; bytes on disk per rung."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dormouse.model.config import ModelConfig
from dormouse.model.gpt import ByteLM
from dormouse.model import quant as Q

torch.set_num_threads(1)

F32, E2M1 = np.float32, ml_dtypes.float4_e2m1fn
GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])  # E2M1 magnitudes, index = code & 7


def ref_e2m1(x: np.ndarray) -> np.ndarray:
    """Brute force: nearest grid magnitude (saturating at 6); on a tie the even code (mantissa bit 0)."""
    mag = np.minimum(np.abs(x), 6.0)[:, None]
    dist = np.abs(mag - GRID)
    tied = dist == dist.min(axis=1, keepdims=True)
    even = tied & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(axis=1), even.argmax(axis=1), tied.argmax(axis=1))
    return np.where(x < 0, -1.0, 1.0) * GRID[idx]


def codes_of(q: torch.Tensor) -> np.ndarray:
    return Q.unpack_nibbles(q).numpy()


def mx_one_block(values) -> tuple[np.ndarray, np.ndarray]:
    """mxfp4 of one row (block scale 2^0 whenever the row's amax is in [4, 8)): (codes, dequantized)."""
    W = torch.from_numpy(np.asarray(values, F32)[None])
    t = Q.quantize("mxfp4", W)
    return codes_of(t["q"])[0, : W.shape[1]], Q.dequantize("mxfp4", t, W.shape)[0].numpy()


# --------------------------------------------------------------------------------------------------
# E2M1 elements
# --------------------------------------------------------------------------------------------------
def test_all_e2m1_values_reachable_with_ml_dtypes_bit_patterns():
    vals = np.concatenate([GRID, -GRID[1:], [-0.0]])  # 16 values, 16 codes
    codes, dq = mx_one_block(vals)  # amax 6 -> scale 2^0: elements are the values themselves
    np.testing.assert_array_equal(dq, vals)
    np.testing.assert_array_equal(codes, vals.astype(E2M1).view(np.uint8))
    assert sorted(codes.tolist()) == list(range(16))
    # the encoding itself: sign bit 3, exponent bits 2..1, mantissa bit 0
    assert codes.tolist()[:8] == [0b0000, 0b0001, 0b0010, 0b0011, 0b0100, 0b0101, 0b0110, 0b0111]


def test_e2m1_ties_to_even_pinned():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    others = [0.24, 0.26, 5.01, 4.99, 2.49, 2.51, 7.0, 6.5]  # not ties; 7 and 6.5 saturate
    others_want = [0.0, 0.5, 6.0, 4.0, 2.0, 3.0, 6.0, 6.0]
    vals = ties + [-v for v in ties] + others + [6.0]
    _, dq = mx_one_block(vals)
    np.testing.assert_array_equal(dq, want + [-v for v in want] + others_want + [6.0])


def test_e2m1_matches_brute_force_reference():
    x = np.random.default_rng(0).uniform(-7, 7, 4096).astype(F32)
    x = np.concatenate([x, np.arange(-28, 29) / 4])  # every quarter step: all ties and grid points
    W = torch.from_numpy(x.astype(F32))
    np.testing.assert_array_equal(Q.e2m1_values(Q.e2m1_codes(W)).numpy(), ref_e2m1(x))


def test_e2m1_codes_are_ml_dtypes_bit_patterns():
    """The torch E2M1 encoder (no numpy: it runs on the weights' device for QAT) against ml_dtypes' cast, bit for
    bit: random values, every quarter step (all ties), signed zeros, tiny and saturating values."""
    x = np.random.default_rng(1).uniform(-8, 8, 20000)
    x = np.concatenate([x, np.arange(-36, 37) / 4, [0.0, -0.0, 1e-30, -1e-30, -0.2, 0.2, 7.9, -100.0, 6.0, -6.0]]).astype(F32)
    want = np.clip(x, -6, 6).astype(E2M1).view(np.uint8)
    np.testing.assert_array_equal(Q.e2m1_codes(torch.from_numpy(x)).numpy(), want)
    np.testing.assert_array_equal(Q.e2m1_values(torch.from_numpy(want)).numpy(), want.view(E2M1).astype(F32))


@pytest.mark.parametrize("rung", Q.RUNGS)
def test_fake_quant_is_what_the_rung_file_holds(rung):
    """fake_quant (QAT's forward) and quantize -> dequantize (export's file) are one computation."""
    g = torch.Generator().manual_seed(0)
    for W in (torch.randn(9, 70, generator=g), torch.randn(3, 40, 48, generator=g) * torch.tensor([0.01, 1, 30])[:, None, None]):
        W.requires_grad_(True)
        fq = Q.fake_quant(rung, W)
        assert not fq.requires_grad and fq.dtype == torch.float32
        assert torch.equal(fq, Q.dequantize(rung, Q.quantize(rung, W), W.shape))
        assert not torch.equal(fq, W.detach())  # every rung moves some weight of a random matrix


def test_nibble_and_crumb_packing():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Q.unpack_nibbles(Q.pack_nibbles(codes)), codes)
    assert Q.pack_nibbles(torch.tensor([0x1, 0x2], dtype=torch.uint8)).tolist() == [0x21]  # low nibble first
    crumbs = torch.randint(0, 3, (64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(Q.unpack_crumbs(Q.pack_crumbs(crumbs)), crumbs)
    # ternary [-1, 0, 1, 1] -> codes [0, 1, 2, 2] -> 0b10_10_01_00
    assert Q.quantize("ternary", torch.tensor([[-1.0, 0.0, 1.0, 1.0]]))["q"].tolist() == [0b10100100]


# --------------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------------
def ref_mxfp4(W: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OCP MX v1.0 sec. 6.3 in float64 per block: X = 2^(floor(log2 amax) - emax_elem), clamped to the
    E8M0 range; P = e2m1(clip(V / X, +-6)). Returns (element codes, scale codes, dequantized)."""
    out, n = W.shape
    Wp = np.zeros((out, -(-n // 32) * 32), F32)
    Wp[:, :n] = W
    B = Wp.reshape(out, -1, 32).astype(np.float64)
    elem = np.zeros(B.shape, np.uint8)
    scale = np.zeros(B.shape[:2], np.uint8)
    dq = np.zeros(B.shape)
    for i, j in np.ndindex(*B.shape[:2]):
        amax = np.abs(B[i, j]).max()
        X = 2.0 ** max(math.floor(math.log2(amax)) - 2, -127) if amax > 0 else 2.0 ** -127
        scale[i, j] = np.array([X], F32).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)[0]
        p = np.clip(B[i, j] / X, -6, 6).astype(E2M1)
        elem[i, j], dq[i, j] = p.view(np.uint8), p.astype(np.float64) * X
    return elem.reshape(out, -1), scale, dq.reshape(out, -1)[:, :n]


def wide_range_matrix(out: int, n: int, seed: int) -> np.ndarray:
    """Rows spread over 2^-30 .. 2^10, one all-zero block, one row near fp32's subnormals."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((out, n)) * np.exp2(rng.integers(-30, 10, (out, 1)))
    W[0, :32] = 0
    W[1] = rng.standard_normal(n) * 2.0 ** -128  # shared exponent below -127: clamped to E8M0's min
    return W.astype(F32)


def test_mxfp4_matches_spec_reference():
    W = wide_range_matrix(9, 70, seed=0)  # 70 = two full blocks and a padded one
    t = Q.quantize("mxfp4", torch.from_numpy(W))
    elem, scale, dq = ref_mxfp4(W)
    assert t["q"].shape == (9, 48) and t["scale"].shape == (9, 3) and t["scale"].dtype == torch.uint8
    np.testing.assert_array_equal(t["scale"].numpy(), scale)
    np.testing.assert_array_equal(codes_of(t["q"]), elem)
    np.testing.assert_array_equal(Q.dequantize("mxfp4", t, W.shape).numpy(), dq.astype(F32))
    assert t["scale"][0, 0] == 0 and (elem[0, :32] == 0).all()  # zero block: code 0 (2^-127), zeros


@pytest.mark.parametrize("m, code, exact", [
    (1.0, 4, True),  # amax = 2^k: amax/X = 4, lands on 4 exactly
    (1.25, 4, False),  # amax/X = 5: a tie, to even -> 4
    (1.26, 6, False),  # 5.04 -> 6
    (1.5, 6, True),  # amax = 6 * 2^(k-2): the only case that lands exactly on 6
    (1.9, 6, False),  # 7.6 clamps to 6 (dequantized 21% low)
])
def test_mxfp4_block_max_lands_on_4_or_6(m, code, exact):
    for k in (-9, 0, 3):
        row = np.full(32, 0.01 * 2.0 ** k)
        row[5] = -m * 2.0 ** k
        codes, dq = mx_one_block(row)
        assert Q.e2m1_values(torch.tensor([codes[5]], dtype=torch.uint8)).item() == -code
        assert dq[5] == -code * 2.0 ** (k - 2)
        assert (dq[5] == F32(row[5])) == exact


# --------------------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------------------
def ref_nvfp4(W: np.ndarray):
    """The NVFP4 rule in numpy fp32 with ml_dtypes casts (same operation order as the brief)."""
    out, n = W.shape
    Wp = np.zeros((out, -(-n // 16) * 16), F32)
    Wp[:, :n] = W
    B = Wp.reshape(out, -1, 16)
    ts = np.abs(W).max() / F32(6 * 448)
    ideal = np.minimum(np.abs(B).max(axis=-1) / F32(6) / ts, F32(448))
    bs = ideal.astype(ml_dtypes.float8_e4m3fn)
    denom = bs.astype(F32) * ts
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(denom[..., None] > 0, B / denom[..., None], F32(0))
    elem = np.clip(x, -6, 6).astype(E2M1)
    dq = (elem.astype(F32) * denom[..., None]).reshape(out, -1)[:, :n]
    return elem.view(np.uint8).reshape(out, -1), bs, ts, dq


def test_nvfp4_matches_reference():
    W = wide_range_matrix(9, 45, seed=1) * F32(2.0 ** 100)  # rows 2^70 .. 2^110: near fp32's top
    W[1] = np.random.default_rng(2).standard_normal(45) * 1e-3  # row 1: some block scales round to 0
    t = Q.quantize("nvfp4", torch.from_numpy(W))
    elem, bs, ts, dq = ref_nvfp4(W)
    assert t["block_scale"].dtype == torch.float8_e4m3fn and t["block_scale"].shape == (9, 3)
    assert t["tensor_scale"].shape == () and t["tensor_scale"].item() == ts
    # block scales: torch's e4m3 cast against ml_dtypes', bit for bit
    np.testing.assert_array_equal(t["block_scale"].view(torch.uint8).numpy(), bs.view(np.uint8))
    np.testing.assert_array_equal(codes_of(t["q"]), elem)
    np.testing.assert_array_equal(Q.dequantize("nvfp4", t, W.shape).numpy(), dq)
    assert (bs.astype(F32) == 0).any()  # the zero-scale path ran


def test_nvfp4_block_max_lands_on_6_when_block_scale_is_e4m3_normal():
    rng = np.random.default_rng(3)
    W = (rng.standard_normal((64, 128)) * np.exp2(rng.uniform(-20, 0, (64, 8)).repeat(16, axis=1))).astype(F32)
    t = Q.quantize("nvfp4", torch.from_numpy(W))
    bs = t["block_scale"].float().numpy()
    normal = bs >= 2.0 ** -6
    assert normal.sum() > 300 and (~normal).sum() > 100  # both kinds of block ran (374 and 138)
    codes = codes_of(t["q"]).reshape(64, 8, 16)
    mag = Q.e2m1_values(torch.from_numpy(codes & 7)).numpy()
    assert (mag.max(axis=-1)[normal] == 6).all()
    amax = np.abs(W).reshape(64, 8, 16).max(axis=-1)
    dq_max = np.abs(Q.dequantize("nvfp4", t, W.shape).numpy()).reshape(64, 8, 16).max(axis=-1)
    assert (np.abs(dq_max - amax)[normal] <= amax[normal] / 16 * (1 + 1e-6)).all()
    # a subnormal block scale makes no such promise: ideal 0.7 * 2^-9 rounds to 2^-9, max lands on 4
    ts = 1.0 / (6 * 448)  # tensor amax 1
    row = np.zeros(32, F32)
    row[0], row[16] = 1.0, 6 * 0.7 * 2.0 ** -9 * ts
    t = Q.quantize("nvfp4", torch.from_numpy(row[None]))
    assert t["block_scale"].float().tolist() == [[448.0, 2.0 ** -9]]
    assert Q.e2m1_values(Q.unpack_nibbles(t["q"]))[0, 16].item() == 4.0


# --------------------------------------------------------------------------------------------------
# int8, fp8, ternary
# --------------------------------------------------------------------------------------------------
def test_int8_per_channel_error_bound():
    W = torch.randn(33, 70, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 1, 33)[:, None]
    t = Q.quantize("int8", W)
    scale = t["scale"]
    assert t["q"].dtype == torch.int8 and torch.equal(scale, W.abs().amax(1) / 127)
    assert (t["q"].abs().amax(1) == 127).all()  # each row's absmax lands on +-127
    err = (W - Q.dequantize("int8", t, W.shape)).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()


def test_fp8_matches_ml_dtypes_e4m3():
    W = torch.randn(17, 40, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 3, 17)[:, None]
    t = Q.quantize("fp8", W)
    assert t["q"].dtype == torch.float8_e4m3fn and torch.equal(t["scale"], W.abs().amax(1) / 448)
    ref = (W.numpy() / t["scale"].numpy()[:, None]).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(t["q"].view(torch.uint8).numpy(), ref.view(np.uint8))
    assert (t["q"].float().abs().amax(1) == 448).all()
    err = (W - Q.dequantize("fp8", t, W.shape)).abs()
    assert (err <= 16 * t["scale"][:, None] * (1 + 1e-6)).all()  # half the e4m3 ulp of [256, 448], 32


def test_ternary_values_scale_and_packed_size():
    for shape in [(3, 7), (4, 4), (1, 1), (5, 33)]:
        W = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        t = Q.quantize("ternary", W)
        n = shape[0] * shape[1]
        assert t["q"].dtype == torch.uint8 and t["q"].numel() == -(-n // 4)
        assert t["scale"].item() == pytest.approx(W.abs().mean().item() + 1e-5, rel=1e-6)
        dq = Q.dequantize("ternary", t, shape)
        q = dq / t["scale"]
        assert set(q.unique().tolist()) <= {-1.0, 0.0, 1.0}
        assert torch.equal(q, torch.round(W / t["scale"]).clamp(-1, 1))


# --------------------------------------------------------------------------------------------------
# Every rung: odd shapes, zero rows/blocks, bad input
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rung", Q.RUNGS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 33), (4, 64)])
def test_odd_shapes_and_zeros_are_finite_and_cropped(rung, shape):
    W = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    W[0] = 0
    W[-1, : min(16, shape[1])] = 0
    for M in (W, torch.zeros(shape)):
        dq = Q.dequantize(rung, Q.quantize(rung, M), shape)
        assert dq.shape == shape and dq.dtype == torch.float32 and torch.isfinite(dq).all()
        assert (dq[M == 0] == 0).all()
        if rung != "ternary":  # a per-tensor +-gamma is far off for single large values
            assert (dq - M).abs().max() <= 0.25 * M.abs().max() + 1e-30


@pytest.mark.parametrize("rung", Q.RUNGS)
def test_a_bank_quantizes_as_its_matrices_would_alone(rung, tmp_path):
    """An MoE bank [E, out, in]: each expert matrix gets its own scales (a per-tensor scale per expert, not
    one over the bank), so the file holds what separate 2-D experts would, stacked; and it round-trips."""
    g = torch.Generator().manual_seed(0)
    bank = torch.randn(3, 72, 64, generator=g) * torch.tensor([0.01, 1.0, 30.0])[:, None, None]  # unequal experts
    parts = Q.quantize(rung, bank)
    alone = [Q.quantize(rung, m) for m in bank]
    assert set(parts) == set(alone[0])
    for k, v in parts.items():
        assert v.shape[0] == 3 and all(torch.equal(v[i].view(torch.uint8) if v.dtype.itemsize == 1 else v[i], a[k].view(
            torch.uint8) if a[k].dtype.itemsize == 1 else a[k]) for i, a in enumerate(alone))
    back = Q.dequantize(rung, parts, bank.shape)
    assert torch.equal(back, torch.stack([Q.dequantize(rung, a, (72, 64)) for a in alone]))
    sd = {"blocks.0.ffn.w_up": bank, "blocks.0.ffn.router.weight": torch.randn(3, 64, generator=g)}
    recipe = Q.save_rung(tmp_path / "m.safetensors", sd, rung)
    assert recipe["tensors"]["blocks.0.ffn.w_up"]["rule"] == rung and recipe["tensors"]["blocks.0.ffn.w_up"]["shape"] == [3, 72, 64]
    assert torch.equal(Q.load_rung(tmp_path / "m.safetensors")["blocks.0.ffn.w_up"], back)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown rung"):
        Q.quantize("int4", torch.ones(2, 2))
    with pytest.raises(ValueError, match="NaN/inf"):
        Q.quantize("mxfp4", torch.tensor([[1.0, float("nan")]]))
    # near fp32's max, mean |W| summed in fp32 overflowed to inf (refused before); summed in fp64 it is the value itself
    big = torch.full((2, 40), 3e38)
    assert torch.equal(Q.dequantize("ternary", Q.quantize("ternary", big), big.shape), big)
    with pytest.raises(ValueError, match="2-D"):
        Q.quantize("int8", torch.ones(4))


# --------------------------------------------------------------------------------------------------
# State dicts and files
# --------------------------------------------------------------------------------------------------
def live_model(seed: int = 0) -> ByteLM:
    cfg = ModelConfig(d_model=64, n_heads=2, head_dim=32, ffn_hidden=96, n_core=2, kda_chunk_size=16,
                      engram=True, engram_rows=97, engram_dim=8)
    torch.manual_seed(seed)
    m = ByteLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # init zeroes the output projections
    return m.eval()


@pytest.mark.parametrize("rung", Q.RUNGS)
def test_state_dict_round_trip_through_safetensors(rung, tmp_path):
    m = live_model()
    sd = m.state_dict()
    path = tmp_path / f"{rung}.safetensors"
    recipe = Q.save_rung(path, sd, rung)
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()[Q.RECIPE_KEY]) == recipe
    rules = {name: e["rule"] for name, e in recipe["tensors"].items()}
    assert set(rules) == set(sd) and recipe["rung"] == rung and set(recipe["rules"]) == set(rules.values())
    assert rules["blocks.0.ffn.w_up.weight"] == rung and rules["blocks.1.mixer.q_proj.weight"] == rung
    for kept_bf16 in ["embed.weight", "head.weight", "norm.weight", "blocks.0.engram.table.weight",
                      "blocks.0.mixer.b_proj.weight", "blocks.0.mixer.A_log"]:
        assert rules[kept_bf16] == "bf16"
    assert rules["blocks.0.engram.hash_moduli"] == "keep"

    back = Q.load_rung(path)
    assert set(back) == set(sd)
    for name, v in back.items():
        assert v.shape == sd[name].shape and v.dtype == sd[name].dtype
        rule = rules[name]
        if rule == "keep":
            assert torch.equal(v, sd[name])
        else:
            assert torch.equal(v, Q.dequantize(rule, Q.quantize(rule, sd[name]), sd[name].shape))
    fresh = ByteLM(m.cfg).eval()
    fresh.load_state_dict(back, strict=True)
    logits, _ = fresh(torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(logits).all()


def test_unclaimed_tensor_and_missing_recipe_are_refused(tmp_path):
    tensors, recipe = Q.quantize_state_dict({"a.weight": torch.randn(8, 8)}, "int8", eligible=lambda n, t: True)
    with pytest.raises(ValueError, match="without a recipe entry"):
        Q.dequantize_state_dict({**tensors, "b.weight::w": torch.zeros(2)}, recipe)
    save_file({"a": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a rung file"):
        Q.load_rung(tmp_path / "plain.safetensors")


def test_bytes_on_disk_decrease_down_the_rungs(tmp_path):
    out, n = 1024, 1024
    W = torch.randn(out, n, generator=torch.Generator().manual_seed(0)) * 0.02
    payload = {"bf16": 2 * out * n, "int8": out * n + 4 * out, "fp8": out * n + 4 * out,
               "mxfp4": out * n // 2 + out * n // 32, "nvfp4": out * n // 2 + out * n // 16 + 4,
               "ternary": out * n // 4 + 4}
    size = {}
    for rung in Q.RUNGS:
        path = tmp_path / f"{rung}.safetensors"
        Q.save_rung(path, {"w": W}, rung, eligible=lambda name, t: True)
        size[rung] = path.stat().st_size
        header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        assert size[rung] - header == payload[rung]
    assert size["bf16"] > max(size["int8"], size["fp8"])
    assert min(size["int8"], size["fp8"]) > max(size["mxfp4"], size["nvfp4"])
    assert size["nvfp4"] > size["mxfp4"] > size["ternary"]


@pytest.mark.parametrize("rung", [r for r in Q.RUNGS if r != "bf16"])
def test_a_bank_at_once_is_its_matrices_one_by_one(rung):
    """The GPU's path (the whole bank in one call) and the CPU's (a matrix at a time) give the same bits."""
    g = torch.Generator().manual_seed(1)
    bank = torch.randn(3, 40, 72, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    q, dq = Q._QUANT[rung]
    whole, alone = q(bank), Q._by_matrix(q, bank)
    for k in whole:
        assert torch.equal(whole[k].view(torch.uint8) if whole[k].dtype.itemsize == 1 else whole[k],
                           alone[k].view(torch.uint8) if alone[k].dtype.itemsize == 1 else alone[k]), (rung, k)
    assert torch.equal(dq(whole, bank.shape), torch.stack([dq({k: v[i] for k, v in alone.items()}, bank.shape[1:])
                                                           for i in range(3)]))


def test_scales_are_correctly_rounded_quotients():
    """Every scale is the fp32 rounding of the exact quotient (a fp64 quotient rounds to it), not a multiply by a
    rounded reciprocal, which CUDA does for a Python-scalar divisor (one ulp off the CPU's file, seen on the H200);
    ternary's mean |W| is summed in fp64, the same on any device and in any order. tests/test_qat.py -k cuda checks
    the GPU's bits against the CPU's."""
    g = torch.Generator().manual_seed(3)
    W = torch.randn(3, 40, 64, generator=g) * torch.tensor([1e-3, 1.0, 700.0])[:, None, None]
    amax = W.abs().amax(dim=-1).double()
    assert torch.equal(Q.quantize("int8", W)["scale"], (amax / Q.INT8_MAX).float())
    assert torch.equal(Q.quantize("fp8", W)["scale"], (amax / Q.E4M3_MAX).float())
    assert torch.equal(Q.quantize("nvfp4", W)["tensor_scale"], (amax.amax(dim=-1) / (Q.E2M1_MAX * Q.E4M3_MAX)).float())
    assert torch.equal(Q.quantize("ternary", W)["scale"], W.abs().double().mean(dim=(-2, -1)).float() + Q.TERNARY_EPS)
