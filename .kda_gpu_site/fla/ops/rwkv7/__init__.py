# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors

from .chunk import chunk_rwkv7
from .fused_recurrent import fused_mul_recurrent_rwkv7, fused_recurrent_rwkv7

__all__ = [
    'chunk_rwkv7',
    'fused_mul_recurrent_rwkv7',
    'fused_recurrent_rwkv7',
]
