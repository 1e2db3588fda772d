"""Shared by every unit test: accelerate keeps process-wide singletons; reset them so each
test picks its own mixed precision and device."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from accelerate.state import AcceleratorState, GradientState, PartialState


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
