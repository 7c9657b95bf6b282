# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors

import torch
import triton
import triton.language as tl

from fla.ops.utils import prepare_chunk_indices


@triton.heuristics({
    'USE_GATE': lambda args: args['g_cumsum'] is not None,
    'IS_VARLEN': lambda args: args['cu_seqlens'] is not None,
})
@triton.jit(do_not_specialize=['T'])
def parallel_path_fwd_kernel(
    q,
    k,
    v,
    o,
    o_new,
    g_cumsum,
    w1,
    w2,
    scale,
    L,
    L_new,
    M,
    cu_seqlens,
    indices,
    T,
    G: tl.constexpr,
    HQ: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_GATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_hq = i_bh // HQ, i_bh % HQ
    i_h = i_hq // G

    if IS_VARLEN:
        i_n, i_t = tl.load(indices + i_t * 2).to(tl.int32), tl.load(indices + i_t * 2 + 1).to(tl.int64)
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = (eos - bos).to(tl.int32)
    else:
        i_n = i_b
        bos, eos = (i_n * T).to(tl.int64), (i_n * T + T).to(tl.int64)

    o_q = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_q = o_q < T
    m_o = m_q[:, None] & (o_v[None, :] < V)
    p_q = q + (bos * HQ + i_hq) * K + o_q[:, None] * (HQ*K) + o_d[None, :]
    b_q = tl.zeros([BT, BK], dtype=tl.float32)
    b_q += tl.load(p_q, mask=m_q[:, None] & (o_d[None, :] < K), other=0.0)
    sm_scale = scale * 1.44269504
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    p_o = o + (bos * HQ + i_hq) * V + o_q[:, None] * (HQ*V) + o_v[None, :]
    b_o += tl.load(p_o, mask=m_o, other=0.0)

    p_L = L + bos * HQ + i_hq + o_q * HQ
    p_M = M + bos * HQ + i_hq + o_q * HQ
    b_l = tl.load(p_L, mask=m_q, other=0.0)
    b_m = tl.load(p_M, mask=m_q, other=0.0)

    if USE_GATE:
        p_g_cumsum_q = g_cumsum + bos * HQ + i_hq + o_q * HQ
        b_g_cumsum_q = tl.load(p_g_cumsum_q, mask=m_q, other=0.0)
    else:
        b_g_cumsum_q = None

    for offset in range((i_t + 1) * BT - 2 * BS, i_t*BT-BS, -BS):
        o_k = offset + tl.arange(0, BS)
        m_k = o_k < T
        p_k = k + (bos * H + i_h) * K + o_d[:, None] + o_k[None, :] * (K*H)  # GQA when H!=HQ
        p_v = v + (bos * H + i_h) * V + o_k[:, None] * (V*H) + o_v[None, :]  # GQA when H!=HQ
        p_w1 = w1 + (bos * H + i_h) * K + o_d[:, None] + o_k[None, :] * (K*H)
        p_w2 = w2 + (bos * H + i_h) * K + o_k[:, None] * (K*H) + o_d[None, :]
        # [BK, BS]

        b_k = tl.load(p_k, mask=(o_d[:, None] < K) & m_k[None, :], other=0.0)
        # [BS, BV]
        b_v = tl.load(p_v, mask=m_k[:, None] & (o_v[None, :] < V), other=0.0)
        # [BK, BK]
        b_w1 = tl.load(p_w1, mask=(o_d[:, None] < K) & m_k[None, :], other=0.0)
        b_w2 = tl.load(p_w2, mask=m_k[:, None] & (o_d[None, :] < K), other=0.0)
        # [BT, BS]
        m_s = i_t * BT + tl.arange(0, BT) >= (offset + BS)
        b_s = tl.dot(b_q.to(b_k.dtype), b_k)

        if USE_GATE:
            p_g_cumsum_k = g_cumsum + (bos * HQ + i_hq) + o_k * HQ
            b_g_cumsum_k = tl.load(p_g_cumsum_k, mask=m_k, other=0.0)
            b_s = b_s + b_g_cumsum_q[:, None] - b_g_cumsum_k[None, :]
        b_s = tl.where(m_s[:, None], b_s * sm_scale, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        alpha = tl.math.exp2(b_m - b_m_new)
        b_s = tl.math.exp2(b_s - b_m_new[:, None])
        b_o *= alpha[:, None]
        b_l = b_l * alpha + tl.sum(b_s, 1)
        b_m = b_m_new
        b_o = tl.dot(b_s.to(b_v.dtype), b_v, b_o)
        b_s2 = tl.dot(b_q.to(b_w1.dtype), b_w1)
        b_s2 = tl.where(m_s[:, None], b_s2, 0)
        b_q -= tl.dot(b_s2.to(b_w2.dtype), b_w2)

    tl.debug_barrier()

    for offset in range(i_t * BT - BS, -BS, -BS):
        o_k = offset + tl.arange(0, BS)
        m_k = o_k < T
        p_k = k + (bos * H + i_h) * K + o_d[:, None] + o_k[None, :] * (K*H)  # GQA when H!=HQ
        p_v = v + (bos * H + i_h) * V + o_k[:, None] * (V*H) + o_v[None, :]  # GQA when H!=HQ
        p_w1 = w1 + (bos * H + i_h) * K + o_d[:, None] + o_k[None, :] * (K*H)
        p_w2 = w2 + (bos * H + i_h) * K + o_k[:, None] * (K*H) + o_d[None, :]
        # [BK, BS]
        b_k = tl.load(p_k, mask=(o_d[:, None] < K) & m_k[None, :], other=0.0)
        # [BS, BV]
        b_v = tl.load(p_v, mask=m_k[:, None] & (o_v[None, :] < V), other=0.0)
        b_w1 = tl.load(p_w1, mask=(o_d[:, None] < K) & m_k[None, :], other=0.0)
        b_w2 = tl.load(p_w2, mask=m_k[:, None] & (o_d[None, :] < K), other=0.0)
        # [BT, BS]
        b_s = tl.dot(b_q.to(b_k.dtype), b_k)
        if USE_GATE:
            p_g_cumsum_k = g_cumsum + (bos * HQ + i_hq) + o_k * HQ
            b_g_cumsum_k = tl.load(p_g_cumsum_k, mask=m_k, other=0.0)
            b_s = b_s + b_g_cumsum_q[:, None] - b_g_cumsum_k[None, :]
        b_s = b_s * sm_scale
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        alpha = tl.math.exp2(b_m - b_m_new)
        b_s = tl.math.exp2(b_s - b_m_new[:, None])
        b_o *= alpha[:, None]
        b_l = b_l * alpha + tl.sum(b_s, 1)
        b_m = b_m_new
        b_o = tl.dot(b_s.to(b_v.dtype), b_v, b_o)
        b_s2 = tl.dot(b_q.to(b_w1.dtype), b_w1)
        b_q -= tl.dot(b_s2.to(b_w2.dtype), b_w2)

    b_o = b_o / b_l[:, None]
    p_o_new = o_new + (bos * HQ + i_hq) * V + o_q[:, None] * (HQ*V) + o_v[None, :]
    tl.store(p_o_new, b_o.to(p_o_new.dtype.element_ty), mask=m_o)
    b_l = tl.math.log2(b_l) + b_m
    p_L_new = L_new + (bos * HQ + i_hq) + o_q * HQ
    tl.store(p_L_new, b_l.to(p_L_new.dtype.element_ty), mask=m_q)


def parallel_path_fwd_fn(
    q,
    k,
    v,
    o,
    g_cumsum,
    w1,
    w2,
    scale,
    L,
    M,
    cu_seqlens,
    BT,
    BS,
    chunk_indices: torch.LongTensor | None = None,
):
    B, T, HQ, K = q.shape
    V = v.shape[-1]
    H = k.shape[-2]
    G = HQ // H
    if chunk_indices is None and cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
    indices = chunk_indices
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(indices)
    grid = (NT, B * HQ)
    o_new = torch.empty_like(o, dtype=v.dtype)
    L_new = torch.empty_like(L)

    parallel_path_fwd_kernel[grid](
        q=q,
        k=k,
        v=v,
        o=o,
        o_new=o_new,
        w1=w1,
        w2=w2,
        g_cumsum=g_cumsum,
        scale=scale,
        cu_seqlens=cu_seqlens,
        indices=indices,
        L=L,
        L_new=L_new,
        M=M,
        T=T,
        K=K,
        V=V,
        BK=triton.next_power_of_2(K),
        BV=triton.next_power_of_2(V),
        G=G,
        HQ=HQ,
        H=H,
        BS=BS,
        BT=BT,
        num_warps=8 if (BT == 128 and K == 128) else 4,
    )
    return o_new, L_new
