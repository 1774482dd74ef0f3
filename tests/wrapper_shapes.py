"""Optimizer wrappers as other libraries write them, shared by the tests that train with them
(tests/test_optimizer_wrappers.py, tests/test_loop_matrix.py).

In-suite copies, each citing what it copies: SAM (davda54/sam), timm's Lookahead (timm cannot be
installed beside this torch: it requires torchvision), and a user's SGD subclass keeping more state
in ``state_dict()`` than in ``state``.
"""

from __future__ import annotations

from typing import Any

import torch


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as davda54/sam (sam.py, the common implementation) writes it:
    the loop calls ``first_step`` (climb to w + e(w)) and ``second_step`` (back to w, then
    ``base_optimizer.step()``), never ``step()``; SAM's own ``state`` holds ``old_p``, the base
    optimizer's holds the momentum."""

    def __init__(self, params: Any, base_optimizer: Any, rho: float = 0.05, adaptive: bool = False,
                 **kwargs: Any) -> None:
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)  # climb to the local maximum "w + e(w)"
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"
        self.base_optimizer.step()  # do the actual "sharpness-aware" update
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is None:
            raise ValueError("Sharpness Aware Minimization requires closure, but it was not provided")
        closure = torch.enable_grad()(closure)
        self.first_step(zero_grad=True)
        closure()
        self.second_step()

    def _grad_norm(self) -> torch.Tensor:
        return torch.norm(torch.stack([((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2)
                                       for group in self.param_groups for p in group["params"]
                                       if p.grad is not None]), p=2)

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict(state_dict)
        self.base_optimizer.param_groups = self.param_groups


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead (timm/optim/lookahead.py, as of 2026): it skips ``Optimizer.__init__`` but
    makes the hook dicts; its own ``state`` stays empty, the slow weights go into the base
    optimizer's state (``lookahead_slow_buff``), and ``state_dict()`` is the base optimizer's."""

    def __init__(self, base_optimizer: torch.optim.Optimizer, alpha: float = 0.5, k: int = 6) -> None:
        # NOTE super().__init__() not called on purpose
        from collections import OrderedDict, defaultdict

        self._optimizer_step_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Any] = OrderedDict()
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state: Any = defaultdict(dict)
        for name, default in defaults.items():
            for group in self._base_optimizer.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group: dict[str, Any]) -> None:
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self._base_optimizer.state[fast_p]
            if "lookahead_slow_buff" not in param_state:
                param_state["lookahead_slow_buff"] = torch.empty_like(fast_p)
                param_state["lookahead_slow_buff"].copy_(fast_p)
            slow = param_state["lookahead_slow_buff"]
            slow.add_(fast_p - slow, alpha=group["lookahead_alpha"])
            fast_p.copy_(slow)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups


class SGDWithShadow(torch.optim.SGD):
    """A user's subclass keeping more state than ``state``: an average of the params, in
    ``state_dict()["shadow"]``."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.shadow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        for s, p in zip(self.shadow, (p for g in self.param_groups for p in g["params"])):
            s.lerp_(p, 0.1)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "shadow": list(self.shadow)}
