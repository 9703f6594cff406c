"""Small models the tests of gradstats.layers and gradstats.fpanalysis.alignment share."""
from __future__ import annotations

import torch
from torch import nn


class Branchy(nn.Module):
    """conv -> bn (fed), conv -> functional relu -> bn (not fed directly, and the structure
    cannot see it), linear -> bn1d (fed), linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.bn_a = nn.BatchNorm2d(4)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.bn_b = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 8 * 8, 6)
        self.bn_fc = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.bn_a(self.a(x))
        x = self.bn_b(torch.relu(self.b(x)))
        return self.head(self.bn_fc(self.fc(x.flatten(1))))
