# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors

from .chunk import chunk_ttt_linear
from .fused_chunk import fused_chunk_ttt_linear

__all__ = [
    'chunk_ttt_linear',
    'fused_chunk_ttt_linear',
]
