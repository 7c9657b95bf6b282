"""Our Triton kernels compiled for an H100 (sm_90) on the CPU, through every stage to a cubin with triton's bundled
ptxas: the typing, promotion and lowering errors that the interpreter (numpy semantics) cannot see, caught before a
GPU runs them. Kernels: the sampler's hash (rowrng_triton), a decode step's convs (conv_step_triton), the training
convs (conv_triton)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="the kernels are Triton")
pytest.importorskip("triton.backends.nvidia", reason="triton's CUDA backend compiles them")

def compile_sm90(fn, pointers: dict[str, str], constexprs: dict[str, int], ints: dict[str, str] | None = None):
    """fn (a JITFunction) compiled for sm_90: pointer args typed as given, constexprs bound, other args i32 (or as
    `ints` says). Returns the compiled kernel's stages."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: pointers.get(a) or (ints or {}).get(a) or ("constexpr" if a in constexprs else "i32")
           for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    return kernel.asm


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))


def test_the_samplers_hash_compiles_for_sm90():
    from dormouse.posttrain import rowrng_triton

    asm = compile_sm90(rowrng_triton._uniforms, {"seed": "*i64", "counter": "*i64", "out": "*fp32"},
                       {"BLOCK": rowrng_triton.BLOCK})
    # literals over 2**31 are uint32 in Triton: they must widen to int64 by value (0x85A308D3, the 32-bit mask)
    assert "cubin" in asm and "2242054355 : i64" in asm["ttir"] and "4294967295 : i64" in asm["ttir"]


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_decode_steps_conv_compiles_for_sm90(W, dtype):
    from dormouse.model import conv_step_triton

    data = ("xq", "xk", "xv", "cq", "ck", "cv", "yq", "yk", "yv", "nq", "nk", "nv")
    pointers = {**{a: "*" + dtype for a in data}, **{a: "*fp32" for a in ("wq", "wk", "wv")}}
    asm = compile_sm90(conv_step_triton._step3, pointers, {"W": W, "BD": conv_step_triton.BD},
                       ints={a: "i64" for a in ("sxq", "sxk", "sxv", "scq_b", "sck_b", "scv_b")})
    assert "cubin" in asm


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_training_convs_compile_for_sm90(dtype):
    from dormouse.model import conv_triton

    fwd = compile_sm90(conv_triton._fwd.fn, {"x": "*" + dtype, "w": "*fp32", "y": "*" + dtype},
                       {"W": 4, "BT": 64, "BD": 64})
    g = compile_sm90(conv_triton._bwd_g.fn, {"x": "*" + dtype, "w": "*fp32", "dy": "*" + dtype, "g": "*" + dtype,
                                              "dw_part": "*fp32"}, {"W": 4, "ROWS": 128, "BT": 32, "BD": 64})
    dx = compile_sm90(conv_triton._bwd_dx.fn, {"w": "*fp32", "g": "*" + dtype, "dx": "*" + dtype},
                      {"W": 4, "BT": 64, "BD": 64})
    assert all("cubin" in asm for asm in (fwd, g, dx))


def test_the_engram_hash_compiles_for_sm90():
    from dormouse.model import engram_triton

    longs = ("idx", "hist", "start", "mult", "moduli", "orders", "nrows", "offsets", "out")
    for has_hist in (True, False):
        asm = compile_sm90(engram_triton._row_ids, {a: "*i64" for a in longs},
                           {"HAS_HIST": has_hist, "HAS_START": has_hist, "N_TABLES": 5, "MAX_ORDER": 4,
                            "BT": engram_triton.BT}, ints={"s_idx": "i64", "s_hist": "i64"})
        assert "cubin" in asm
