# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors


# Portions adapted from CyclicFlowAttention, Copyright (c) 2026 Yixiao Chen.
# https://github.com/Chyxx/CyclicFlowAttention

from __future__ import annotations

from .chunk import chunk_cyfa
from .fused_recurrent import fused_recurrent_cyfa
from .naive import naive_recurrent_cyfa

__all__ = [
    "chunk_cyfa",
    "fused_recurrent_cyfa",
    "naive_recurrent_cyfa",
]
