"""QA tests drive the product as users do: tiny models, one intra-op thread (a shared
2-core box), and accelerate's process-wide singletons reset between tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState, PartialState

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
