"""The engine equivalence suite on a device, in bf16: streamed training against stock.

The families and plan kinds of `tests/engine/test_equivalence.py` (its helpers, imported
from tests/engine), each trained 3 AdamW steps twice on the same device under bf16
autocast: the stock model (weights on the device) and a streamed twin (`attach`, bf16
compute copies, fp32 host masters). On CUDA this is the only run of the engine's CUDA
paths (side stream, events, pinned staging); bf16 rounding differs between the two, so
losses are compared with a bf16 tolerance, not bit for bit (the CPU suite is exact).

    python bench/gpu_equivalence.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from engine_helpers import ARCH_CONFIGS, PLAN_KINDS, batches, build_model, make_plan, twin

from lazytrain_accel.engine import attach

#: Relative loss difference tolerated in bf16 (as tests/frontends' bf16 check).
BF16_REL_TOL = 2e-2


@dataclass(kw_only=True)
class EquivalenceResult:
    arch: str
    kind: str
    max_rel_loss_diff: float
    passed: bool
    wall_s: float


def _layers_for(kind: str) -> int:
    return 10 if kind == "mixed" else 4


def check_one(arch: str, kind: str, device: torch.device, steps: int = 3
              ) -> EquivalenceResult:
    start = time.perf_counter()
    num_layers = _layers_for(kind)
    ref = build_model(arch, num_layers)
    model = twin(ref)
    ref.to(device)
    engine = attach(model, make_plan(kind, num_layers), device=device,
                    compute_dtype=torch.bfloat16, nvme_dir=tempfile.mkdtemp())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worst = 0.0
    try:
        for step, ids in enumerate(batches(steps)):
            ids = ids.to(device)
            losses = []
            for net, optimizer in ((ref, opt_ref), (model, opt)):
                torch.manual_seed(step)  # the same dropout masks for both
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = net(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss))
            worst = max(worst, abs(losses[1] - losses[0]) / max(abs(losses[0]), 1e-6))
    finally:
        engine.detach()
    return EquivalenceResult(arch=arch, kind=kind, max_rel_loss_diff=worst,
                             passed=worst <= BF16_REL_TOL, wall_s=time.perf_counter() - start)


def check_all(device: torch.device, archs: list[str] | None = None,
              kinds: list[str] | None = None) -> list[EquivalenceResult]:
    return [check_one(arch, kind, device)
            for arch in (archs or sorted(ARCH_CONFIGS)) for kind in (kinds or PLAN_KINDS)]


def format_table(results: list[EquivalenceResult]) -> str:
    rows = [f"{'family':<10}{'plan':<16}{'max rel loss diff':>19}{'ok':>5}"]
    rows += [f"{r.arch:<10}{r.kind:<16}{r.max_rel_loss_diff:>19.2e}{'yes' if r.passed else 'NO':>5}"
             for r in results]
    return "\n".join(rows)


def as_dicts(results: list[EquivalenceResult]) -> list[dict]:
    return [asdict(r) for r in results]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    results = check_all(torch.device(parser.parse_args().device))
    print(format_table(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
