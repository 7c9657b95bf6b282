# Copyright (c) 2023-2026, Songlin Yang, Yu Zhang, Zhiyuan Li
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
# For a list of all contributors, visit:
#   https://github.com/fla-org/flash-linear-attention/graphs/contributors

from .chunk import chunk_momentum_delta_rule
from .fused_recurrent import fused_recurrent_momentum_delta_rule
from .naive import chunk_momentum_delta_rule_ref, recurrent_momentum_delta_rule_ref

__all__ = [
    'chunk_momentum_delta_rule',
    'chunk_momentum_delta_rule_ref',
    'fused_recurrent_momentum_delta_rule',
    'recurrent_momentum_delta_rule_ref',
]
