# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors

from .chunk import chunk_mesa_net
from .decoding_one_step import mesa_net_decoding_one_step
from .naive import naive_mesa_net_decoding_one_step, naive_mesa_net_exact

__all__ = ['chunk_mesa_net', 'mesa_net_decoding_one_step', 'naive_mesa_net_decoding_one_step', 'naive_mesa_net_exact']
