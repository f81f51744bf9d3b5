"""Fixtures for the model tests: schemas to run every model on, one thread per test."""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_schema

from terarec.types import FeatureSchema


@pytest.fixture(params=["tiny", "criteo"])
def schema(request) -> FeatureSchema:
    return tiny_schema(missing_flags=True) if request.param == "tiny" else FeatureSchema.criteo()


@pytest.fixture(autouse=True)
def single_thread():
    """These tensors are tiny: thread hand-offs cost more than the math, and on a busy
    machine spinning OpenMP workers slow the tests down a hundredfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
