"""Say so when a loop never steps the optimizer the Recorder was given.

The Recorder takes its records at that optimizer's step hooks. A loop that updates
the params by hand (``p.data -= lr * p.grad``) or steps another optimizer object
trains normally and records nothing, silently. :class:`StepWatch` looks at the loop
only until the first step of the optimizer given (then it removes its hooks and costs
nothing) and warns once, through logging like every warning of the Recorder, when:

* the params changed **3 times** between training forwards / ``rec.log()`` calls with
  no step: an update is happening outside that optimizer. Only never-seen values count
  (a sample of the first and last param the optimizer holds), so what a healthy loop
  does before its first step does not: gradient accumulation (params unchanged over
  any number of micro-batches), evaluation (under ``no_grad``, or with grad: no change),
  loading a checkpoint or swapping EMA weights in and back (at most 2 new values);
* 1024 training forwards and ``log()`` calls passed with no step (a change the sample
  cannot see): generous, so accumulation of hundreds of micro-batches never warns;
* the Recorder is closed after 3 or more of them with no step at all: the run holds no step;
* at once, when another optimizer that the one given holds in an attribute, or that steps all of
  its params, runs ``step()`` first (SAM's ``first_step`` / ``second_step`` step
  ``SAM.base_optimizer``, never ``SAM.step()``): the warning names it, since that is the
  optimizer to give the Recorder. Another optimizer stepping only some of the params (a second
  pair of a joint run sharing a module) is only named if a warning comes.

A step begins for the watch at the optimizer's step pre-hook (LBFGS: before its closure
runs forward again and again while it changes the params), or when the Recorder's step
count moves (``capture()`` + ``end_step()``, a GradScaler step it skipped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stepdump.capture.handles import Hook

log = logging.getLogger(__name__)

UPDATES = 3  # param changes without a step before the warning
EVENTS = 1024  # training forwards + log() calls without a step before the warning, whatever changed
_SAMPLE = 256  # elements of each watched param compared
_SEEN = 8  # distinct values remembered per watched param


class StepWatch:
    """Watches ``model`` and ``optimizer`` until ``optimizer`` first steps; warns once (module doc).

    ``step`` returns the Recorder's step count (a change means a step ended). Register
    nothing else: :attr:`handles` go with the Recorder's own, removed at close.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], int]) -> None:
        self._optimizer, self._step, self._first = optimizer, step, step()
        self.done = False
        self.events = self.updates = 0
        params = [p for g in optimizer.param_groups for p in g["params"] if isinstance(p, torch.Tensor)]
        self._watched = list({id(p): p for p in params[:1] + params[-1:]}.values())
        self._seen: list[list[torch.Tensor]] = [[] for _ in self._watched]
        self._ids = {id(p) for p in params}
        self.stepped_instead: str | None = None  # the optimizer that stepped these params instead, named
        self.handles: list[Any] = [optimizer.register_step_pre_hook(Hook(self._step_began)),
                                   register_optimizer_step_pre_hook(Hook(self._any_step_began))]
        if not isinstance(model, torch.jit.ScriptModule):  # TorchScript runs no Python hooks
            self.handles.append(model.register_forward_pre_hook(Hook(self._forward)))

    # -- events ------------------------------------------------------------------
    def _step_began(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.done = True  # removed at the next forward or at close: optimizer hooks may be iterating now

    def _any_step_began(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Any optimizer's step pre-hook: another one stepping these params before the one given did."""
        if self.done or optimizer is self._optimizer or self.stepped_instead is not None:
            return
        try:
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if not ids & self._ids:
                return
            attr = next((a for a, v in vars(self._optimizer).items() if v is optimizer), None)
            cls = type(optimizer).__name__
            self.stepped_instead = f"{type(self._optimizer).__name__}.{attr}" if attr else cls
            if attr is not None or self._ids <= ids:  # the optimizer doing the update: say so now
                # (the hooks stay until the next forward or close: torch is iterating over them now)
                self._warn(f"{cls}.step() ({self.stepped_instead}) updated its params", stop=False)
        except Exception as e:  # noqa: BLE001 - do no harm: a hint is not worth a failure
            log.debug("stepdump: the step watch stopped: %s", e)
            self.done = True

    def _forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.event()

    def event(self) -> None:
        """A training forward or a ``log()`` call: one more sign of an iteration."""
        if self.done or torch.compiler.is_compiling():
            if self.handles and self.done:
                self._stop()
            return
        if self._step() != self._first:
            self._stop()
            return
        try:
            self.events += 1
            self.updates += self._changed()
            if self.updates >= UPDATES:
                self._warn(f"the params changed {self.updates} times between training forwards / log() calls")
            elif self.events >= EVENTS:
                self._warn(f"{self.events} training forwards and log() calls passed")
        except Exception as e:  # noqa: BLE001 - do no harm: a hint is not worth a failure
            log.debug("stepdump: the step watch stopped: %s", e)
            self._stop()

    def closing(self) -> None:
        """The Recorder closes: a loop that never stepped recorded no step at all."""
        if not self.done and self._step() == self._first and self.events >= UPDATES:
            self._warn(f"the Recorder was closed after {self.events} training forwards and log() calls", final=True)
        self._stop()

    # -- inside ----------------------------------------------------------------------
    def _changed(self) -> int:
        """1 if a watched param holds a value not seen before (the first look is the baseline)."""
        new = 0
        for p, seen in zip(self._watched, self._seen):
            sample = p.detach().reshape(-1)[:_SAMPLE].clone()
            if any(torch.equal(sample, s) for s in seen):
                continue
            new |= bool(seen)
            seen.append(sample)
            del seen[:-_SEEN]
        return new

    def _warn(self, what: str, final: bool = False, stop: bool = True) -> None:
        give = (f"Give the Recorder {self.stepped_instead}, whose step() your loop calls (or the optimizer "
                "whose step() does the update)" if self.stepped_instead is not None
                else "Give the Recorder the optimizer whose step() your loop calls")
        log.warning(
            "stepdump: %s with no step of the optimizer given to the Recorder (%s); stepdump records at that "
            "optimizer's step(), so %s. %s; for a hand-written update (p -= lr * p.grad), call rec.capture() "
            "right before it and rec.end_step() right after it.", what, type(self._optimizer).__name__,
            "the run holds no step" if final else "nothing is being recorded", give)
        if stop:
            self._stop()
        else:
            self.done = True

    def _stop(self) -> None:
        """Watch no more: remove the hooks (safe here: no optimizer hook loop is running)."""
        self.done = True
        self._seen = []
        for h in self.handles:
            h.remove()
        self.handles = []
