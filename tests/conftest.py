"""pytest fixtures and hooks; the hypothesis profiles are registered by importing _strategies.

Shared helpers (dtypes, the accuracy contract, capability flags) live in _helpers.py.
"""

from __future__ import annotations

import _strategies  # noqa: F401  (registers the hypothesis profiles ci and long)
import pytest
import torch
from _helpers import HAS_CUDA


@pytest.fixture(
    params=[pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
)
def device(request):
    if request.param == "cuda" and not HAS_CUDA:
        pytest.skip("no CUDA device")
    return torch.device(request.param)
