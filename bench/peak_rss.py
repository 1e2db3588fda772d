"""This process's resident memory from /proc (Linux): the one reader the benchmarks and the
memory tests share.

`start_peak()` resets the peak (VmHWM := VmRSS, through /proc/self/clear_refs) and returns
the resident bytes now; `peak_growth_bytes(baseline)` is the peak since, above them.
`pss_bytes(pid)` is a process's proportional set size (shared pages count 1/N in each of
the N processes that map them), so the PSS of several processes sums to their bytes.
"""

from __future__ import annotations

from pathlib import Path


def status_bytes(field: str) -> int:
    """A byte field of /proc/self/status (VmRSS, VmHWM, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status: this measurement needs Linux")


def start_peak() -> int:
    """Reset the peak resident set to the current one; returns the resident bytes now."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return status_bytes("VmRSS")


def peak_growth_bytes(baseline_bytes: int) -> int:
    """The peak resident set since `start_peak()`, above its `baseline_bytes`."""
    return status_bytes("VmHWM") - baseline_bytes


def pss_bytes(pid: int | str = "self") -> int:
    """The proportional set size of process `pid` (default: this one), from
    /proc/<pid>/smaps_rollup."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup: this measurement needs Linux")
