# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors

# Context Parallel operators and utilities

from .comm import (
    all_gather_into_tensor,
    all_reduce_sum,
    conv_cp_send_recv_bwd,
    conv_cp_send_recv_fwd,
    send_recv_bwd,
    send_recv_fwd,
)
from .context import (
    FLACPContext,
    build_cp_context,
)

__all__ = [
    "FLACPContext",
    "all_gather_into_tensor",
    "all_reduce_sum",
    "build_cp_context",
    "conv_cp_send_recv_bwd",
    "conv_cp_send_recv_fwd",
    "send_recv_bwd",
    "send_recv_fwd",
]
