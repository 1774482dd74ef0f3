"""The CUDA paths, checked on a real GPU (not part of `make test`: CI has no GPU).

Run on a machine with CUDA: ``python benchmarks/cuda_check.py``. It checks, and
exits non-zero if any check fails:

* staging: pinned host buffers, filled by non_blocking copies on a side stream;
* recorded tensors equal the live CUDA tensors bitwise, at every step, for
  AdamW (foreach and fused), Adam(capturable=True), SGD with sparse embedding
  grads, LBFGS with a closure, and fp16 autocast + GradScaler with a skipped step;
* recording does not change the training (bitwise equal to an unrecorded run);
* restore into fresh CUDA objects continues bit-identically;
* device-side stats agree with the CPU stats of the same tensors;
* overhead of stats-only and full recording on a ~50M-parameter model.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from helpers import assert_same, snapshot  # noqa: E402

import stepdump  # noqa: E402
from stepdump.core.stats import compute_stats  # noqa: E402

DEV = torch.device("cuda")
FAILED: list[str] = []


def check(name: str, fn) -> None:  # noqa: ANN001
    try:
        fn()
        print(f"ok    {name}")
    except Exception as e:  # noqa: BLE001 - report every check
        FAILED.append(name)
        print(f"FAIL  {name}: {type(e).__name__}: {e}")


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


def build(kind: str, seed: int = 0):  # noqa: ANN201
    torch.manual_seed(seed)
    model = Net(sparse=kind == "sgd-sparse").to(DEV)
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
        for slot in rec._pool._free.queue:  # buffers of tensors that live on the GPU are pinned
            pinned += [b.is_pinned() for (k, name), b in slot.buffers.items() if k == "params" and name in on_gpu]
        assert pinned and all(pinned), f"staging buffers of CUDA params pinned: {sum(pinned)}/{len(pinned)}"
    for (name, p), q in zip(model.named_parameters(), plain[0].parameters()):
        assert_same(p.detach(), q.detach(), f"{kind}: training unchanged, {name}")
    with stepdump.open(root / kind) as run:
        assert run.steps == list(range(n)), run.steps
        if kind == "amp":
            assert run.skipped_steps == [3], run.skipped_steps
        for t in range(n):
            for k in ("params", "grads", "optimizer"):
                got = run.tensors(t, k)
                want = snaps[t][k]
                assert sorted(got) == sorted(want), f"step {t} {k}: {sorted(got)} != {sorted(want)}"
                for name, w in want.items():
                    w = w.to_dense() if w.is_sparse else w
                    assert_same(got[name], w.cpu(), f"{kind} step {t} {k} {name}")
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


def overhead(root: Path) -> None:
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
    for label, kw in (("stats only (every=None)", {"every": None}), ("full every step", {"every": 1})):
        with stepdump.Recorder(root / label.split()[0], model, opt, **kw) as rec:
            steps(3)
            ms = steps(10 if kw["every"] else 20)
        rows.append((label, ms))
        del rec
    params = sum(p.numel() for p in model.parameters())
    print(f"overhead, {params / 1e6:.1f}M params, AdamW fused, {torch.cuda.get_device_name()}:")
    for label, ms in rows:
        print(f"  {label:28s} {ms:8.2f} ms/step  {ms / base:5.2f}x")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    # Bitwise comparisons need deterministic kernels (index_add_ of sparse grads uses atomics otherwise).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for kind in ("adamw-foreach", "adamw-fused", "adam-capturable", "sgd-sparse", "lbfgs", "amp"):
            check(f"fidelity {kind}", lambda k=kind: fidelity(k, root))
        check("overhead", lambda: overhead(root))
    print(f"{len(FAILED)} failed: {FAILED}" if FAILED else "all CUDA checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
