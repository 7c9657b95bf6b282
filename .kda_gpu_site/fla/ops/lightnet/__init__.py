# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors

from fla.ops.lightnet.chunk import chunk_lightnet
from fla.ops.lightnet.fused_recurrent import fused_recurrent_lightnet

__all__ = [
    'chunk_lightnet',
    'fused_recurrent_lightnet',
]
