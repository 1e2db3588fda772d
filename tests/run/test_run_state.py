"""The run's plan lives in its `RunState` only: whatever adopts a new one (a checkpoint's
longer shape, a longer batch, a re-planner switch), the engine and the re-planner see
that very object (issue 31: the re-planner kept its own copy and priced the old one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lazytrain_accel.engine.stats import StepStats
from lazytrain_accel.run.batch_shape import Sizing
from lazytrain_accel.run.node_layout import NodeLayout
from lazytrain_accel.run.replanner import Replanner
from lazytrain_accel.run.setup import PreparedRun
from lazytrain_accel.run.state import RunState


class FakeEngine:
    """Records the plans it is given; refuses one marked `runnable=False`."""

    def __init__(self, plan: SimpleNamespace) -> None:
        self.plan, self.plans = plan, []

    def set_plan(self, plan: SimpleNamespace) -> None:
        if not plan.runnable:
            raise ValueError("the layers cannot run this plan's query blocks")
        self.plan = plan
        self.plans.append(plan)

    def total_stats(self) -> StepStats:
        return StepStats()


def _run(step_s: float, *, runnable: bool = True) -> PreparedRun:
    plan = SimpleNamespace(prediction=SimpleNamespace(step_s=step_s), runnable=runnable,
                           resident_update="host")
    return PreparedRun(model_profile=None, hardware=None, plan=plan)


def _state() -> RunState:
    first = _run(1.0)
    engine = FakeEngine(first.plan)
    state = RunState(plugin=None, launch=None, model=None, run=first, layout=NodeLayout(),
                     budgets=None,
                     sizing=Sizing(batch_size=2, seq_len=6, source="the first batch"),
                     engine=engine, guard=None)
    state.replanner = Replanner(engine=engine, state=state, budgets=None,
                                solve=lambda run: pytest.fail("no solve in this test"),
                                min_gain=0.05, include_optimizer=True)
    return state


def test_after_adopt_the_engine_and_the_replanner_see_the_states_plan() -> None:
    state = _state()
    longer = _run(2.0)
    sizing = Sizing(batch_size=2, seq_len=32, source="the checkpoint's plan")
    state.adopt(longer, sizing)
    assert state.run is longer and state.sizing is sizing
    assert state.engine.plan is state.run.plan and state.engine.plans == [longer.plan]
    assert state.replanner.run is state.run
    assert state.replanner.predicted_step_s == 2.0  # priced on the adopted plan


def test_adopting_the_engines_own_plan_does_not_set_it_twice() -> None:
    """A re-planner switch or a longer batch sets the engine's plan through `adopt` once."""
    state = _state()
    state.adopt(_run(1.0))
    assert len(state.engine.plans) == 1
    state.adopt(PreparedRun(model_profile=None, hardware=None, plan=state.engine.plan))
    assert len(state.engine.plans) == 1 and state.run.plan is state.engine.plan


def test_a_plan_the_engine_refuses_changes_nothing() -> None:
    state = _state()
    first = state.run
    with pytest.raises(ValueError, match="query blocks"):
        state.adopt(_run(0.5, runnable=False), Sizing(batch_size=2, seq_len=64, source="x"))
    assert state.run is first and state.sizing.seq_len == 6
    assert state.engine.plan is first.plan and state.replanner.run is first
