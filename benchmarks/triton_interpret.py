"""Triton kernels on the CPU under TRITON_INTERPRET=1 (the tests' and benchmarks' one set-up for it): the variable
must be set before triton is imported, and two gaps of triton 3.6's interpreter are closed here.

- It has no benchmarker: an autotuned kernel's configs all time the same, and the first one wins.
- A scalar kernel argument is a 1-element array, and `tl.range(0, T)` takes its int() (interpreter.py's __index__),
  which numpy 2 refuses for arrays of one dimension ("only 0-dimensional arrays can be converted"): FLA's
  `fused_recurrent_kda` loops so. Here __index__ reads the array's one element."""

from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton_interpret.apply: set TRITON_INTERPRET=1 before triton is imported")
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    autotuner.Autotuner._bench = lambda self, *a, **kw: [1.0, 1.0, 1.0]
    real = interpreter._patch_lang_tensor
    if getattr(real, "dormouse_index_fix", False):
        return

    def patch_lang_tensor(tensor, scope):
        real(tensor, scope)  # the scope restores the original attributes after the launch, this one too
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0]) if self.handle.data.size == 1 \
            else int(self.handle.data)

    patch_lang_tensor.dormouse_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
