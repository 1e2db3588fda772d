"""`profiling/calibration.py`: rates from one step's figures, running medians that settle,
and a calibrated profile that changes the rates only."""

from __future__ import annotations

import pytest

from lazytrain_accel.profiling.calibration import (
    RateEstimate,
    StepSample,
    calibrate,
    drifts,
    step_rates,
)
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS


def _sample(**overrides) -> StepSample:
    fields = dict(
        transfer_s={"h2d": 0.01, "weights_h2d": 0.03, "d2h": 0.0, "grads_d2h": 0.02,
                    "nvme_read": 0.0005, "nvme_write": 0.0},
        transfer_bytes={"h2d": 1_000_000, "weights_h2d": 3_000_000, "d2h": 0,
                        "grads_d2h": 1_000_000, "nvme_read": 10, "nvme_write": 0},
        layer_compute_s=0.5, layer_flops=2e9, optimizer_update_s=0.1,
        updated_param_count=1_000_000)
    return StepSample(**{**fields, **overrides})


def test_a_link_rate_sums_its_kinds_and_skips_what_the_step_barely_used() -> None:
    rates = step_rates(_sample())
    assert rates["h2d"] == pytest.approx(4e6 / 0.04)  # activations and weights, one link
    assert rates["d2h"] == pytest.approx(1e6 / 0.02)
    assert "nvme_read" not in rates and "nvme_write" not in rates  # 0.5 ms: timer noise
    assert rates["compute"] == pytest.approx(4e9) and rates["host_update"] == pytest.approx(1e7)


def test_the_drive_rates_count_the_host_states_io_beside_the_boundaries() -> None:
    """Issue 44: the state homed on NVMe crosses the same drive as the boundaries' hops, so
    a drive slower than its profile shows in either (each kind its busy seconds)."""
    rates = step_rates(_sample(
        transfer_s={"nvme_read": 0.01, "state_nvme_read": 0.03, "state_nvme_write": 0.02},
        transfer_bytes={"nvme_read": 1_000_000, "state_nvme_read": 3_000_000,
                        "state_nvme_write": 2_000_000}))
    assert rates["nvme_read"] == pytest.approx(4e6 / 0.04)
    assert rates["nvme_write"] == pytest.approx(2e6 / 0.02)  # the state's writes alone


def test_the_median_ignores_one_outlier_and_settles_only_when_still() -> None:
    estimate = RateEstimate(window_steps=3, settle_steps=2, tolerance=0.2)
    for value in (100.0, 5.0, 100.0):  # one step slowed by something else
        estimate.add({"h2d": value})
    assert estimate.medians() == {"h2d": 100.0}
    assert not estimate.settled()  # the median still moved (5 -> 100 over two steps)
    estimate.add({"h2d": 110.0})
    assert estimate.settled()
    for value in (300.0, 300.0):  # the link changed: the median moves, then settles
        estimate.add({"h2d": value})
    assert estimate.medians() == {"h2d": 300.0} and not estimate.settled()
    estimate.add({"h2d": 300.0})
    assert estimate.settled()


def test_calibrate_replaces_the_measured_rates_only_and_drifts_names_the_largest() -> None:
    h800 = HARDWARE_PRESETS["h800"]
    calibrated = calibrate(h800, {"nvme_read": 1e8, "compute": 1e14}, where="a test")
    assert calibrated.nvme_read_bytes_per_s == 1e8 and calibrated.achieved_flops_per_s == 1e14
    assert calibrated.h2d_bytes_per_s == h800.h2d_bytes_per_s
    assert calibrated.gpu_memory_bytes == h800.gpu_memory_bytes
    assert calibrated.name == "calibrated-h800" and "a test" in calibrated.source
    again = calibrate(calibrated, {"nvme_read": 2e8}, where="again")
    assert again.name == "calibrated-h800" and again.source.count("| base:") == 1
    name, before, after = drifts(h800, calibrated)[0]
    assert (name, before, after) == ("nvme_read", h800.nvme_read_bytes_per_s, 1e8)


def test_run_totals_survive_the_period_resets_other_readers_make() -> None:
    from lazytrain_accel.engine.stats import Accounting

    acct = Accounting()
    acct.add_transfer("h2d", 0.5, 100)
    acct.add("compute_s", 1.0)
    acct.reset()  # a progress line's interval ended
    acct.add_transfer("h2d", 0.25, 50)
    assert acct.snapshot().transfer_bytes["h2d"] == 50
    totals = acct.totals()
    assert totals.transfer_bytes["h2d"] == 150 and totals.transfer_s["h2d"] == 0.75
    assert totals.compute_s == 1.0 and acct.snapshot().compute_s == 0.0


def test_the_step_overhead_is_the_median_residual_of_the_window_and_never_negative() -> None:
    from lazytrain_accel.profiling.calibration import StepOverheadFit, with_step_overhead

    fit = StepOverheadFit(window_steps=3)
    assert fit.step_overhead_s() is None and not fit.full()
    for measured_s, modeled_s in ((1.0, 0.7), (1.5, 0.7), (0.9, 0.7), (1.0, 0.8)):
        fit.add(measured_s, modeled_s)
    assert fit.full() and fit.recent() == pytest.approx([0.8, 0.2, 0.2])
    assert fit.step_overhead_s() == pytest.approx(0.2)  # the 0.3 left the window
    for _ in range(3):
        fit.add(0.5, 0.7)  # the simulator above the measured step: no negative overhead
    assert fit.step_overhead_s() == 0.0
    calibrated = calibrate(HARDWARE_PRESETS["rtx3090"], {"compute": 1e13}, where="a test")
    fitted = with_step_overhead(calibrated, 0.0123)
    assert fitted.step_overhead_s == 0.0123
    assert "step overhead 12.3 ms (fitted)" in fitted.source
    assert fitted.source.endswith(calibrated.source.split(" | base: ")[1])
