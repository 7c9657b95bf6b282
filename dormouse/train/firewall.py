"""The NaN firewall of a training step: a step whose loss or gradient norm is not finite changes
nothing (no weight, no optimizer state) and is counted; more than `max_bad_steps` in a row abort.

Two ways to decide, with the same result:
- host: the loss's finiteness reaches the host before backward and the gradient norm's after it (two
  syncs a step). CPU runs use it: there a sync costs nothing.
- device (CUDA): the decision stays a tensor, so the step never waits for the GPU. Backward and every
  optimizer step always run; fused AdamW skips its own update from `found_inf` (as under GradScaler),
  StackedMuon from `step(ok=...)`, and any other optimizer (torch's Muon) gets its parameters and state
  put back with torch.where. The counts
  stay on the device until `read()` (log and checkpoint steps), so an abort for too many bad steps in a
  row comes at the next read, at most log_every steps late.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dormouse.train import distributed
from dormouse.train.optim import StackedMuon


class BadStepsError(RuntimeError):
    pass


def _fused_adam(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and bool(opt.defaults.get("fused"))


def _state_tensors(opt: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {(id(p), k): v for p, st in opt.state.items() for k, v in st.items() if isinstance(v, torch.Tensor)}


def guarded_step(opt: torch.optim.Optimizer, ok: torch.Tensor) -> None:
    """opt.step(), undone on the device where `ok` (a bool scalar tensor) is False."""
    if isinstance(opt, StackedMuon):  # it takes the decision itself: no copies of the weights and state
        opt.step(ok=ok)
        return
    if _fused_adam(opt):
        opt.found_inf = (~ok).float()
        try:
            opt.step()
        finally:
            del opt.found_inf
        return
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    old_params = [p.detach().clone() for p in params]
    old_state = {k: v.clone() for k, v in _state_tensors(opt).items()}
    opt.step()
    with torch.no_grad():
        for p, old in zip(params, old_params):
            p.copy_(torch.where(ok, p, old))
        # State the step created (Muon's momentum, a first step's moments) starts at zero when made.
        for key, v in _state_tensors(opt).items():
            v.copy_(torch.where(ok, v, old_state[key] if key in old_state else torch.zeros_like(v)))


class Firewall:
    """backward (of each micro-batch), gradient clipping, the optimizer steps (or none of them) and zero_grad, for one step."""

    def __init__(self, opts, params, grad_clip: float, max_bad_steps: int, world: distributed.World,
                 on_device: bool):
        self.opts, self.params, self.grad_clip, self.max_bad = opts, list(params), grad_clip, max_bad_steps
        self.world, self.on_device = world, on_device
        self.bad_in_row = 0  # host path; the device path keeps tensors until read()
        self.skipped = 0  # skipped steps not yet handed out by take_skipped()
        self.last_loss: float | torch.Tensor | None = None
        self._loss: torch.Tensor | None = None  # the step's logged loss so far (its micro-batches' mean)
        self._part_bad = False  # host path: a micro-batch of this step was not finite
        self._nonfinite: torch.Tensor | None = None  # device path: the same, as a count on the device
        if on_device:
            dev = self.params[0].device
            if dev.type != "cpu" and any(isinstance(o, (torch.optim.Adam, torch.optim.AdamW)) and not _fused_adam(o)
                                         for o in opts):
                raise ValueError("firewall on the device: a non-fused Adam keeps its step count on the host (use fused=True)")
            self._skipped_read = 0
            self._skipped = torch.zeros((), dtype=torch.int64, device=dev)
            self._bad = torch.zeros((), dtype=torch.int64, device=dev)
            self._bad_max = torch.zeros((), dtype=torch.int64, device=dev)

    def resume(self, bad_in_row: int) -> None:
        """Carry a resumed run's count of bad steps in a row."""
        self.bad_in_row = bad_in_row
        if self.on_device:
            self._bad.fill_(bad_in_row)

    def step(self, loss: torch.Tensor, total: torch.Tensor, where: str) -> None:
        """A whole step from one forward: `loss` is what is logged, `total` what is minimised (loss + auxiliary terms)."""
        self.backward(loss, total)
        self.finish(where)

    def backward(self, loss: torch.Tensor, total: torch.Tensor, parts: int = 1) -> None:
        """One of a step's `parts` micro-batches (equal rows each; gradient accumulation): total / parts is
        backpropagated into the summed gradients, the logged loss is the parts' mean, and one non-finite part makes
        the whole step bad. `finish` then clips and steps once."""
        scaled = total if parts == 1 else total / parts  # the parts' gradients add up to the whole batch's mean
        if self.on_device:
            nonfinite = (~torch.isfinite(total.detach())).float()
            if self.world.size > 1:  # a collective on the device: no host wait
                dist.all_reduce(nonfinite, op=dist.ReduceOp.SUM)
            self._nonfinite = nonfinite if self._nonfinite is None else self._nonfinite + nonfinite
            scaled.backward()  # always: DDP's gradient all-reduce needs every rank
            part = loss.detach() if parts == 1 else loss.detach() / parts
        else:
            # Every rank takes the decision together, before backward: DDP's all-reduce in backward needs
            # all of them or it hangs. Summed with it: the loss, for the global mean.
            loss_sum, nonfinite = distributed.all_sum(torch.stack([loss.detach().float(), (~torch.isfinite(total.detach())).float()]), self.world)
            part = loss_sum / self.world.size if parts == 1 else loss_sum / self.world.size / parts
            if nonfinite != 0:
                self._part_bad = True
            elif not self._part_bad:
                scaled.backward()
        self._loss = part if self._loss is None else self._loss + part

    def finish(self, where: str, keep_grads: bool = False) -> None:
        """Clip, the optimizer steps (or none of them) and zero_grad, once the step's micro-batches are backpropagated.
        keep_grads: zero the gradient buffers instead of freeing them (a graphed backward's gradients alias the graph's
        own buffers until something else holds them, so a second micro-batch's replay would overwrite the first's)."""
        if self.on_device:
            self._finish_device()
        else:
            self._finish_host(where)
        for opt in self.opts:
            opt.zero_grad(set_to_none=not keep_grads)

    def _finish_host(self, where: str) -> None:
        self.last_loss, self._loss = self._loss, None
        ok, self._part_bad = not self._part_bad, False
        if ok:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            ok = bool(torch.isfinite(grad_norm))  # the same on every rank: the gradients were all-reduced
        if ok:
            for opt in self.opts:
                opt.step()
            self.bad_in_row = 0
            return
        self.skipped += 1
        self.bad_in_row += 1
        if self.bad_in_row > self.max_bad:
            raise BadStepsError(f"pretrain: {self.bad_in_row} non-finite steps in a row at {where}; aborting")

    def _finish_device(self) -> None:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        ok = torch.isfinite(grad_norm) & (self._nonfinite == 0)
        for opt in self.opts:
            guarded_step(opt, ok)
        bad = ~ok
        self._skipped += bad
        self._bad = (self._bad + 1) * bad
        torch.maximum(self._bad_max, self._bad, out=self._bad_max)
        self.last_loss, self._loss, self._nonfinite = self._loss, None, None

    def read(self, where: str) -> float:
        """The last step's loss (mean over ranks) as a float; on the device path, also the counts (one
        sync) and the abort check."""
        if not self.on_device:
            return self.last_loss
        loss_sum, skipped, bad, bad_max = distributed.all_sum(
            torch.stack([self.last_loss.float(), self._skipped.float(), self._bad.float(), self._bad_max.float()]), self.world)
        w = self.world.size  # the counts are the same on every rank: summed, they are w times one rank's
        self.skipped += int(skipped / w) - self._skipped_read
        self._skipped_read = int(skipped / w)
        self.bad_in_row = int(bad / w)
        if bad_max / w > self.max_bad:
            raise BadStepsError(f"pretrain: {int(bad_max / w)} non-finite steps in a row by {where} "
                                f"(more than max_bad_steps {self.max_bad}); aborting")
        return loss_sum / w

    def take_skipped(self) -> int:
        """Skipped steps counted since the last call (after a read on the device path)."""
        n, self.skipped = self.skipped, 0
        return n
