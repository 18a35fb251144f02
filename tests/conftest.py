"""pytest fixtures and hooks; the hypothesis profiles are registered by importing _strategies.

Shared helpers (dtypes, the accuracy contract, capability flags) live in _helpers.py.
"""

from __future__ import annotations

import os

import _strategies  # noqa: F401  (registers the hypothesis profiles ci and long)
import pytest
import torch
from _helpers import HAS_CUDA
from hypothesis import settings

import rope_ext


def pytest_configure(config):
    # The hypothesis profile of this run (make test: --hypothesis-profile=ci, derandomized) also holds in the
    # child pytest runs of test_cpu_isa.py, through the environment.
    profile = config.getoption("hypothesis_profile", None) or os.environ.get("ROPE_EXT_HYPOTHESIS_PROFILE")
    if profile:
        settings.load_profile(profile)
        os.environ["ROPE_EXT_HYPOTHESIS_PROFILE"] = profile


def pytest_sessionstart(session):
    # test_cpu_isa.py runs the CPU matrix once per instruction set, in a child pytest that must use it.
    package = os.environ.get("ROPE_EXT_EXPECT_PACKAGE")  # make test-sanitize: its build, not the in-place one
    if package and not rope_ext.__file__.startswith(os.path.abspath(package)):
        pytest.exit(f"ROPE_EXT_EXPECT_PACKAGE={package} but rope_ext is {rope_ext.__file__}", returncode=3)
    want = os.environ.get("ROPE_EXT_EXPECT_CPU_ISA")
    if want and rope_ext._cpu_isa() != want:
        pytest.exit(
            f"ROPE_EXT_EXPECT_CPU_ISA={want} but the CPU kernel runs {rope_ext._cpu_isa()}", returncode=3
        )


def pytest_report_header(config):
    return [
        f"rope_ext CPU kernel: {rope_ext._cpu_isa()}",
        "first, the files that take minutes (compilers, child processes): " + ", ".join(_SLOW_FILES_FIRST),
    ]


@pytest.fixture(
    params=[pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
)
def device(request):
    if request.param == "cuda" and not HAS_CUDA:
        pytest.skip("no CUDA device")
    return torch.device(request.param)


# Files that take minutes (builds, compilers, child processes) run first: with pytest-xdist (`make test`) they
# then overlap the many short files instead of ending the run on one worker while the others idle.
_SLOW_FILES_FIRST = (
    "test_export_aoti.py",
    "test_wheel.py",
    "test_layers.py",
    "test_neon.py",
    "test_cpu_isa.py",
    "test_cmake.py",
    "test_distributed_models.py",
    "test_build.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file stays
