"""`lazytrain demo` with replan="auto" (the default): once the profile is calibrated to
what this machine measures, the printed prediction tracks the measured step (issue 24),
whether or not the plan changes. The fixture's profile carries the GPU estimates of the
overhead terms (far below this CPU's): what is left beyond the calibrated rates is fitted
as the step's own overhead (`StepOverheadFit`), as a real run fits it."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

from lazytrain_accel.cli import main
from lazytrain_accel.progress import PROGRESS_EVERY_STEPS

STEPS = 4 * PROGRESS_EVERY_STEPS
#: Progress lines before this step average steps the re-planner had not calibrated yet
#: (warm-up, then a window of medians).
CALIBRATED_BY_STEP = PROGRESS_EVERY_STEPS
#: Demo runs tried (see the test).
ATTEMPTS = 2
_LINE = re.compile(r"^step (\d+)/\d+ .* step ([\d.]+) s \(predicted ([\d.]+) s\)$")


@pytest.mark.alone
def test_the_calibrated_prediction_tracks_the_measured_step(
        tmp_path: Path, hardware_json: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAZYTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LAZYTRAIN_REPLAN", "auto")
    monkeypatch.setenv("LAZYTRAIN_THREADS", "1")  # two spin on a busy 2-core machine
    # The calibration and the lines it is checked against are steps of one run; a load
    # that changes mid-run (another job on a shared machine) moves the ratio by itself. A
    # prediction that is off misses in every attempt.
    attempts = []
    for attempt in range(ATTEMPTS):
        ratios = _ratios(tmp_path / f"attempt{attempt}", hardware_json, capsys)
        attempts.append(ratios)
        print("measured/predicted", ratios)
        if abs(statistics.median(ratios) - 1) <= 0.15:
            return
    pytest.fail(f"median measured/predicted outside 0.85-1.15 in every attempt: {attempts}")


def _ratios(tmp_path: Path, hardware_json: Path,
            capsys: pytest.CaptureFixture[str]) -> list[float]:
    """measured / predicted step of the progress lines after calibration."""
    code = main(["demo", "--steps", str(STEPS), "--batch-size", "4", "--eval-count", "4",
                 "--hardware", str(hardware_json), "--nvme-dir", str(tmp_path / "nvme"),
                 "--output-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [m.groups() for m in map(_LINE.match, out.splitlines()) if m]
    ratios = [float(measured_s) / float(predicted_s)
              for step, measured_s, predicted_s in lines if int(step) > CALIBRATED_BY_STEP]
    assert len(ratios) == 3, out  # the lines of steps 20, 30 and 40
    return ratios
