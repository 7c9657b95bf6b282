# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors

from fla.backends import TritonAscendBackend

from .chunk import chunk_simple_gla
from .fused_chunk import fused_chunk_simple_gla
from .fused_recurrent import fused_recurrent_simple_gla
from .parallel import parallel_simple_gla

__all__ = [
    'chunk_simple_gla',
    'fused_chunk_simple_gla',
    'fused_recurrent_simple_gla',
    'parallel_simple_gla',
]


if TritonAscendBackend.is_available():
    from fla.ops.simple_gla.backends.triton_ascend import fused_chunk, fused_recurrent, parallel  # noqa: F401
