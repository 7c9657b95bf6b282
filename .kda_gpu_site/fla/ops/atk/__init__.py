# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors

# ATK kernels
# Shared by precond_gated_delta_rule and precond_kda

from fla.ops.atk.chunk_atk_bwd import chunk_atk_bwd
from fla.ops.atk.chunk_atk_fwd import chunk_atk_fwd, recompute_atk_fwd

__all__ = ['chunk_atk_bwd', 'chunk_atk_fwd', 'recompute_atk_fwd']
