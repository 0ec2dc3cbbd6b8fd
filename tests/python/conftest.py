"""Shared fixtures for the qkv Python tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv

# Every backend this build runs, each tested the same way ("auto" resolves to one).
BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(
        name not in qkv.available_backends(), reason=f"backend {name!r} not built"))
    for name in ("reference", "cpu")
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(20240611)
