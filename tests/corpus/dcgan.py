"""A GAN the pytorch/examples dcgan way: two models, two optimizers, one Recorder for each.

Imitates pytorch/examples ``dcgan/main.py``: ``weights_init`` (normal(0, 0.02) weights,
BatchNorm scales normal(1, 0.02)), ``BCELoss``, ``Adam(lr=2e-4, betas=(0.5, 0.999))`` for each
network, and per iteration the discriminator update on a real and a fake batch
(``errD_real.backward()``, ``errD_fake.backward()`` on ``fake.detach()``) then the generator
update through the discriminator. As users record such a loop today, each optimizer gets its
own Recorder and run (``D`` and ``G``), and each logs what dcgan prints for it (its loss,
``D(x)``, ``D(G(z))``). Neither loss is expected to fall: the two models play against each
other. Linear layers stand in for the convolutions; the "images" are 16-vectors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import stepdump
from corpus import MODES

STEPS, NZ, D_IMG = 30, 8, 16
FAULTS: dict[str, int] = {}


def weights_init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm1d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def record(path: Path, mode: str, fault: str | None = None) -> dict[str, Path]:
    torch.manual_seed(0)
    netG = nn.Sequential(nn.Linear(NZ, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, D_IMG), nn.Tanh())
    netD = nn.Sequential(nn.Linear(D_IMG, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
    netG.apply(weights_init)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(D_IMG, generator=gen).tanh() * 0.8
    with stepdump.Recorder(path / "D", netD, optD, **MODES[mode]) as rec_d, \
            stepdump.Recorder(path / "G", netG, optG, **MODES[mode]) as rec_g:
        for _ in range(STEPS):
            real = mean + 0.1 * torch.randn(16, D_IMG, generator=gen)
            netD.zero_grad()
            label = torch.full((16,), 1.0)
            output = netD(real).view(-1)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()
            fake = netG(torch.randn(16, NZ, generator=gen))
            label.fill_(0.0)
            output = netD(fake.detach()).view(-1)
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            optD.step()
            rec_d.log(loss=(errD_real + errD_fake).item(), D_x=D_x, D_G_z1=D_G_z1)
            netG.zero_grad()
            label.fill_(1.0)
            output = netD(fake).view(-1)
            errG = criterion(output, label)
            errG.backward()
            optG.step()
            rec_g.log(loss=errG.item(), D_G_z2=output.mean().item())
    return {"D": path / "D", "G": path / "G"}
