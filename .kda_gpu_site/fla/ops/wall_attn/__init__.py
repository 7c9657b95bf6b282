# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors
#
# Wall attention, contributed by Tilde Research (Timor Averbuch, Dhruv Pai).

from .decode import build_wall_kv_cache, parallel_wall_attn_decode
from .naive import naive_wall_attn
from .parallel import parallel_wall_attn

__all__ = [
    'build_wall_kv_cache',
    'naive_wall_attn',
    'parallel_wall_attn',
    'parallel_wall_attn_decode',
]
