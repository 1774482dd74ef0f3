"""The CUDA workloads and checks shared by ``tests_gpu/`` and ``benchmarks/cuda_check.py`` (one copy).

Not a test module (pytest collects ``test_*.py`` only): :func:`fidelity` runs one optimizer
configuration recorded on the GPU and asserts, bitwise, that

* staging buffers of CUDA params are pinned host memory (filled by non_blocking copies on a
  side stream);
* recording does not change the training (equal to an unrecorded run, itself checked against a
  second unrecorded run: the control that torch is deterministic here);
* every recorded tensor equals the live CUDA tensor at every step;
* device-side stats agree with the CPU stats of the same tensors;
* restore into fresh CUDA objects at a middle step continues bit-identically.

:func:`overhead` measures ms/step of a ~50M-parameter MLP unrecorded, stats-only and full
(printed by ``cuda_check.py``; the targets are asserted in test_device_lean_contract.py).
Importing this module needs no GPU (``pytest --collect-only tests_gpu`` runs on CPU).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from helpers import assert_same, snapshot
from torch import nn

import stepdump
from stepdump.core.stats import compute_stats

DEV = torch.device("cuda")
KINDS = ("adamw-foreach", "adamw-fused", "adam-capturable", "sgd-sparse", "lbfgs", "amp")


class Net(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, sparse=sparse)
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(self.emb(idx).mean(1)))))


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randint(0, 50, (8, 5), generator=g).to(DEV), torch.randn(8, 4, generator=g).to(DEV)


def build(kind: str, seed: int = 0) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net(sparse=kind == "sgd-sparse").to(DEV)
    opt: torch.optim.Optimizer
    if kind == "adamw-foreach":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    elif kind == "adamw-fused":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    elif kind == "adam-capturable":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    elif kind == "sgd-sparse":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # sparse momentum state
    elif kind == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    else:  # amp
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10) if kind == "amp" else None
    return model, opt, scaler


def train(kind: str, model, opt, scaler, steps: range, rec=None, snaps=None) -> None:  # noqa: ANN001
    for t in steps:
        x, y = batch(t)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if snaps is not None and len(snaps) == t:
                snaps.append(snapshot(model, opt))
            return loss

        if kind == "lbfgs":
            opt.step(closure)
        elif scaler is not None:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            if t == 3:
                loss = loss * float("inf")
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if snaps is not None:
                snaps.append(snapshot(model, opt))
            scaler.step(opt)
            scaler.update()
        else:
            loss = closure()
            opt.step()
        if rec is not None and kind != "lbfgs":
            rec.log(loss=loss)


def fidelity(kind: str, root: Path) -> None:
    n = 6
    plain = build(kind)
    train(kind, *plain, range(n))
    again = build(kind)
    train(kind, *again, range(n))
    for (name, p), q in zip(plain[0].named_parameters(), again[0].parameters()):  # the control
        assert_same(p.detach(), q.detach(), f"{kind}: torch itself is not deterministic here ({name})")
    model, opt, scaler = build(kind)
    snaps: list = []
    with stepdump.Recorder(root / kind, model, opt, scaler=scaler, on_error="raise") as rec:
        pinned = []
        train(kind, model, opt, scaler, range(n), rec, snaps)
        on_gpu = {n for n, p in model.named_parameters()}
        for slot in rec._pool._slots:  # buffers of tensors that live on the GPU are pinned
            pinned += [b.is_pinned() for (k, name), b in slot.buffers.items() if k == "params" and name in on_gpu]
        assert pinned and all(pinned), f"staging buffers of CUDA params pinned: {sum(pinned)}/{len(pinned)}"
    for (name, p), q in zip(model.named_parameters(), plain[0].parameters()):
        assert_same(p.detach(), q.detach(), f"{kind}: training unchanged, {name}")
    with stepdump.open(root / kind) as run:
        assert run.steps == list(range(n + 1)), run.steps  # updates 0..n-1 and the final record (close())
        assert run.meta.get("final_step") == n, run.meta.get("final_step")
        final = run.tensors(n, "params")
        for name, p in model.named_parameters():
            assert_same(final[name], p.detach().cpu(), f"{kind}: final record {name}")
        if kind == "amp":
            assert run.skipped_steps == [3], run.skipped_steps
        for t in range(n):
            for k in ("params", "grads", "optimizer"):
                got = run.tensors(t, k)
                want = snaps[t][k]
                assert sorted(got) == sorted(want), f"step {t} {k}: {sorted(got)} != {sorted(want)}"
                for name, w in want.items():
                    g = got[name]
                    if w.is_sparse and g.is_sparse:  # stored as found (FORMAT.md "Sparse tensors"): bitwise
                        assert_same(g._indices(), w._indices().cpu(), f"{kind} step {t} {k} {name} indices")
                        assert_same(g._values(), w._values().cpu(), f"{kind} step {t} {k} {name} values")
                        continue
                    w = w.to_dense() if w.is_sparse else w  # optimizer state kept dense
                    assert_same(g, w.cpu(), f"{kind} step {t} {k} {name}")
        # device stats against the CPU's, for every recorded grad of the last step
        stats = run.stats("grads")
        for name, w in snaps[n - 1]["grads"].items():
            row = stats[(stats["step"] == n - 1) & (stats["name"] == name)].iloc[0]
            cpu = compute_stats((w.to_dense() if w.is_sparse else w).cpu())
            assert int(row["numel"]) == cpu[0] and int(row["nan"]) == cpu[1], (name, row, cpu)
            for col, ref in zip(("min", "max", "mean", "std", "norm"), cpu[4:9]):
                if ref is not None:
                    assert abs(float(row[col]) - ref) <= 1e-5 * max(1.0, abs(ref)), (name, col, row[col], ref)
        # restore at a middle step into fresh CUDA objects and continue
        mid = n // 2
        fresh = build(kind, seed=1)
        run.restore(mid, fresh[0], fresh[1], scaler=fresh[2])
        train(kind, *fresh, range(mid, n))
        for (name, p), q in zip(fresh[0].named_parameters(), model.parameters()):
            assert_same(p.detach(), q.detach(), f"{kind}: restored at {mid} and continued, {name}")
        for (name, b), c in zip(fresh[0].named_buffers(), model.buffers()):
            assert_same(b.detach(), c.detach(), f"{kind}: buffer {name}")


def overhead(root: Path) -> list[tuple[str, float]]:
    """ms/step of a ~50M-param MLP with AdamW: no recording, stats only, full every step."""
    torch.manual_seed(0)
    width = 2048
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(12)]).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(256, width, device=DEV)

    def steps(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1000

    steps(5)
    base = steps(20)
    rows = [("no recording", base)]
    kws: tuple[tuple[str, dict[str, Any]], ...] = (("stats only (every=None)", {"every": None}), ("full every step", {"every": 1}))
    for label, kw in kws:
        with stepdump.Recorder(root / label.split()[0], model, opt, **kw) as rec:
            steps(3)
            ms = steps(10 if kw["every"] else 20)
        rows.append((label, ms))
        del rec
    return rows


class Gpt2Small(nn.Module):
    """A GPT-2-small-sized model (124M params: 12 pre-LN blocks, d=768, 12 heads, tied head).

    The lean target's workload (docs/cuda.md): the same shapes as benchmarks/leave_on_gpt2.py,
    written with torch's own encoder layer so the test needs nothing from benchmarks/.
    """

    def __init__(self, vocab: int = 50257, d: int = 768, layers: int = 12, heads: int = 12, block: int = 1024) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.h = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.ln_f(self.h(x, mask=mask, is_causal=True))
        return x @ self.wte.weight.T


def gpt2_step_times(root: Path, rounds: int = 6, steps: int = 10, batch: int = 8,
                    seq: int = 1024) -> dict[str, list[float]]:
    """ms/step of GPT-2 small (AdamW fused, bf16 autocast) per arm, arms interleaved ``rounds`` times.

    Arms: ``plain`` (unrecorded), ``lean`` (``every=None, stats_every=1``) and ``floor``
    (``torch._foreach_norm`` over what a lean step records: params, grads and the AdamW moments,
    read once by one fused multi-tensor kernel: what a device-side lean pass cannot beat). One
    model and optimizer for all arms, so only recording differs.
    """
    torch.manual_seed(0)
    model = Gpt2Small().to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, 50257, (batch, seq), device=DEV)
    params = [p for p in model.parameters()]

    def run(n: int, floor: bool = False) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(idx[:, :-1])
            nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
            if floor:
                moments = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
                torch._foreach_norm(params + [p.grad for p in params if p.grad is not None] + moments)
            opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1000

    run(3)  # warm-up: kernels chosen, optimizer state allocated
    times: dict[str, list[float]] = {"plain": [], "lean": [], "floor": []}
    def lean(r: int) -> float:
        with stepdump.Recorder(root / f"lean{r}", model, opt, every=None, stats_every=1, on_error="raise"):
            run(2)  # the recorder's first steps allocate its buffers
            return run(steps)

    arms = {"plain": lambda r: run(steps), "floor": lambda r: run(steps, floor=True), "lean": lean}
    order = list(arms)
    for r in range(rounds):
        for name in order[r % 3:] + order[:r % 3]:  # each arm first, second and third as often
            times[name].append(arms[name](r))
        with stepdump.open(root / f"lean{r}") as rec:  # what the recorder says it cost the training thread
            own = rec.scalars("sys/recorder_ms")
            times.setdefault("recorder_ms", []).append(float(own["sys/recorder_ms"].iloc[2:].median()))
    return times
