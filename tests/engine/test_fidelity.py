"""Plan fidelity while training: report lines, and a warning naming the drifted term."""

from __future__ import annotations

import logging

import pytest

from lazytrain_accel.engine.stats import StepStats
from lazytrain_accel.engine.step.fidelity import FidelityMonitor, StepTerms, drifted_term
from lazytrain_accel.planning.plan import Prediction

PREDICTION = Prediction(step_s=1.0, compute_s=0.6, recompute_s=0.1, exposed_s=0.2)


def test_terms_of_a_prediction_and_of_engine_stats():
    predicted = StepTerms.predicted(PREDICTION, micro_batches=2)
    assert (predicted.step_s, predicted.compute_s, predicted.exposed_s) == (2.0, 1.4, 0.4)
    assert predicted.other_s == pytest.approx(0.2)
    stats = StepStats(compute_s=2.0, recompute_s=1.0, stall_s=0.5)
    measured = StepTerms.measured(4.0, stats, steps=2)
    assert (measured.step_s, measured.compute_s, measured.exposed_s) == (2.0, 1.5, 0.25)


def test_a_lasting_drift_warns_once_naming_the_term(caplog):
    monitor = FidelityMonitor(tolerance=0.25, patience=3)
    predicted = StepTerms.predicted(PREDICTION)
    slow_links = StepTerms(step_s=1.5, compute_s=0.7, exposed_s=0.7)
    with caplog.at_level(logging.WARNING, logger="lazytrain_accel"):
        line = monitor.observe(predicted, StepTerms(step_s=1.1, compute_s=0.7, exposed_s=0.2))
        assert "predicted 1.000 s, measured 1.100 s (1.10x)" in line
        for _ in range(2):
            monitor.observe(predicted, slow_links)
        assert not caplog.records  # two drifting intervals: not yet
        for _ in range(3):
            monitor.observe(predicted, slow_links)
    assert len(caplog.records) == 1  # once per drift, not every interval
    message = caplog.records[0].getMessage()
    assert "1.50x" in message and "exposed_s term drifted" in message and "link" in message


def test_the_drifted_term_is_the_largest_difference():
    predicted = StepTerms(step_s=1.0, compute_s=0.6, exposed_s=0.2)
    assert drifted_term(predicted, StepTerms(step_s=1.6, compute_s=1.1, exposed_s=0.2)) \
        == "compute_s"
    assert drifted_term(predicted, StepTerms(step_s=1.6, compute_s=0.6, exposed_s=0.2)) \
        == "other_s"


def test_add_step_reports_every_interval():
    monitor = FidelityMonitor(interval_steps=2)
    lines: list[str] = []
    for step_s in (1.0, 1.2, 0.9, 0.9):
        monitor.add_step(PREDICTION, step_s, StepStats(compute_s=0.5), lines.append)
    assert len(lines) == 2 and "measured 1.100 s" in lines[0] and "measured 0.900 s" in lines[1]
