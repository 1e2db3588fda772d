"""`lazytrain max-seq` for every preset model x GPU: the longest sequence at batch 1, its
predicted step, where the boundaries live and what stops a longer one (docs/benchmarks.md,
"Long context").

    PYTHONPATH=. python bench/max_seq.py [--models llama3-8b ...] [--hardware h200 ...]
    PYTHONPATH=. python bench/max_seq.py --markdown docs/benchmarks.md   # regenerate the doc

Prints a Markdown table, one row as soon as it is searched. `--markdown FILE` also
replaces the table between the `<!-- max_seq table -->` and `<!-- /max_seq table -->`
lines of FILE (with the date and commit it was made at), so rerunning that command after
a planner or engine change regenerates the documented table. Default budgets: each
hardware preset's GPU, host and NVMe. The solver is single-threaded (SCIP's default) and
each solve has `--time-limit` seconds; rows run one after another.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import time
from pathlib import Path

from lazytrain_accel.planning import PlanInfeasibleError, make_plan
from lazytrain_accel.planning.admission import max_seq_len
from lazytrain_accel.planning.problem import GIB
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model_configs import (
    MODEL_PRESETS,
    geometry_from_config,
    load_model_config,
    profile_model,
)

STEP_TOKENS = 1024
LIMIT_TOKENS = 1 << 26
BEGIN, END = "<!-- max_seq table -->", "<!-- /max_seq table -->"
HEADER = ("| model | GPU | max seq (batch 1) | step s | boundaries GPU / CPU / NVMe / "
          "recomputed | peak GPU / host / NVMe GiB | tile / query block tokens | "
          f"at +{STEP_TOKENS} tokens: short tier, largest term | solve s / search s |\n"
          "|---|---|---|---|---|---|---|---|---|")
_TERM = re.compile(r"its largest term is (.*?) \(([\d.]+ [KMG]iB)\)")


def limit_of(err: PlanInfeasibleError) -> str:
    """The binding tiers of a refusal and the largest term of the first one's base."""
    tiers = " + ".join(tier.upper() for tier in err.shortfall_bytes) or "solver limit"
    term = _TERM.search(str(err))
    return f"{tiers}: {term.group(1)} ({term.group(2)})" if term else tiers


def row(model_name: str, hardware_name: str, time_limit_s: float) -> str:
    geometry = geometry_from_config(load_model_config(model_name), name=model_name)
    hardware = HARDWARE_PRESETS[hardware_name]
    request = PlanRequest(time_limit_s=time_limit_s)

    def at(seq_len: int):
        return profile_model(geometry, batch_size=1, seq_len=seq_len, loss_chunk_tokens=None,
                             tile_tokens=None)

    start = time.perf_counter()
    try:
        best = max_seq_len(at, hardware, request, step_tokens=STEP_TOKENS,
                           limit_tokens=LIMIT_TOKENS)
    except PlanInfeasibleError as err:
        return (f"| {model_name} | {hardware_name} | < {STEP_TOKENS} | | | | | "
                f"{limit_of(err)} | |")
    search_s = time.perf_counter() - start
    plan = make_plan(at(best), hardware, request)
    if best + STEP_TOKENS > LIMIT_TOKENS:
        limit = f"search limit {LIMIT_TOKENS:,}"
    else:
        try:
            make_plan(at(best + STEP_TOKENS), hardware, request)
            limit = "plans (solver limit during the search)"
        except PlanInfeasibleError as err:
            limit = limit_of(err)
    homes = plan.count_homes()
    p = plan.prediction
    tiles = (f"{plan.tile_tokens} / {plan.attention_block_tokens or 'whole'}"
             if plan.tile_tokens else "untiled")
    return (f"| {model_name} | {hardware_name} | {best:,} | {p.step_s:,.0f} | "
            f"{homes['gpu']} / {homes['cpu']} / {homes['nvme']} / {homes['recompute']} | "
            f"{p.peak_gpu_bytes / GIB:.1f} / {p.peak_cpu_bytes / GIB:.1f} / "
            f"{p.peak_nvme_bytes / GIB:.1f} | {tiles} | {limit} | "
            f"{plan.solver.solve_s:.2f} / {search_s:.0f} |")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_markdown(path: Path, rows: list[str], command: str) -> None:
    """Replace the lines between BEGIN and END in `path` by the table."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no '{BEGIN}' ... '{END}' lines to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    made = (f"Made by `{command}` on {datetime.date.today().isoformat()} at commit "
            f"{_commit()}.")
    path.write_text(f"{head}{BEGIN}\n{made}\n\n{HEADER}\n" + "\n".join(rows) + f"\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[m for m in MODEL_PRESETS
                                                          if m != "tiny-demo"])
    parser.add_argument("--hardware", nargs="+", default=list(HARDWARE_PRESETS))
    parser.add_argument("--time-limit", type=float, default=20.0,
                        help="seconds each MIP solve may take (default 20)")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="also write the table between the max_seq table markers of "
                             "this file (docs/benchmarks.md)")
    args = parser.parse_args()
    print(HEADER, flush=True)
    rows = []
    for model_name in args.models:
        for hardware_name in args.hardware:
            rows.append(row(model_name, hardware_name, args.time_limit))
            print(rows[-1], flush=True)
    if args.markdown is not None:
        command = "PYTHONPATH=. python bench/max_seq.py --markdown docs/benchmarks.md"
        if args.models != parser.get_default("models") or \
                args.hardware != parser.get_default("hardware"):
            command = "PYTHONPATH=. python bench/max_seq.py (a subset of rows)"
        write_markdown(args.markdown, rows, command)


if __name__ == "__main__":
    main()
