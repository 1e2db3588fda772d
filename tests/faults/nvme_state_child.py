"""Child of test_fault_nvme_state's kill test (argv: a work directory, lives, steps).

It imports once, then forks each life in turn (before any torch work starts a thread
pool): a life trains an 8-layer Llama whose DRAM budget homes its compute copies, some
gradients and some masters and moments on NVMe (`<dir>/nvme`), from the latest
checkpoint `<dir>/ckpt-<k>` (k steps done), saving one after every step and printing
"saved <pid> <k>", its losses in `<dir>/losses-<pid>`. The test kills each of the first
`lives` - 1 lives; the last trains to `steps` and writes the weights to `<dir>/final.pt`.
Then a reference life trains the same steps in `<dir>/reference` without a kill.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from test_nvme_copies_plugin import LAYERS, _masters_budget_gb
from test_step_overlap_plugin import _build, _loader

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.optim import HybridAdamW8bit

#: Between steps: the kills land among the steps' state writes, not after the last.
STEP_PAUSE_S = 0.05


def _latest(directory: Path) -> int:
    done = [int(p.name.split("-")[1]) for p in directory.glob("ckpt-*") if p.is_dir()]
    return max(done, default=0)


def life(directory: Path, steps: int) -> None:
    torch.set_num_threads(1)
    budget_gb = _masters_budget_gb()  # every part of some layers on NVMe
    batches = list(_loader(num=2 * steps))
    model = _build("llama", LAYERS).eval()  # no dropout: the steps' math alone
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800", resident_update="host",
                             cache_dir=str(directory / "cache"), nvme_dir=str(directory / "nvme"),
                             cpu_memory_limit_gb=budget_gb)
    acc = Accelerator(cpu=True, mixed_precision="bf16", plugin=plugin)
    model, opt = acc.prepare(model, HybridAdamW8bit(model.parameters(), lr=1e-2,
                                                    max_grad_norm=0.5))
    state = acc.lazytrain.run.plan.state
    assert state.copies and state.grads and state.optimizer, state
    start = _latest(directory)
    if start:
        acc.load_state(str(directory / f"ckpt-{start}"))
    with open(directory / f"losses-{os.getpid()}", "w") as log:
        for k in range(start, steps):
            loss = model(**batches[k]).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            log.write(f"{k} {loss.item()!r}\n")
            log.flush()
            acc.save_state(str(directory / f"ckpt-{k + 1}"))
            acc.lazytrain_wait_for_checkpoint()
            print(f"saved {os.getpid()} {k + 1}", flush=True)
            time.sleep(STEP_PAUSE_S)
    acc.end_training()  # the masters homed on NVMe back in the parameters
    weights = {n: q.detach().clone() for n, q in acc.unwrap_model(model).named_parameters()}
    torch.save(weights, directory / "final.pt")


def _fork(directory: Path, steps: int) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            life(directory, steps)
            code = 0
        finally:
            sys.stdout.flush()
            os._exit(code)
    return pid


def main(directory: Path, lives: int, steps: int) -> None:
    for _ in range(lives):
        _, status = os.waitpid(_fork(directory, steps), 0)
        print(f"ended {os.waitstatus_to_exitcode(status)}", flush=True)
    reference = directory / "reference"
    reference.mkdir()
    _, status = os.waitpid(_fork(reference, steps), 0)
    print(f"ended {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
