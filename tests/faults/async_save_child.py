"""Child of test_fault_async_checkpoint's kill test (argv: a directory, a count).

It imports once, then forks `count` runs (before any torch work starts a thread pool),
each in `<directory>/run<i>`: train `tiny_model`, publish checkpoint_0, start
checkpoint_1 asynchronously with a slow writer, print "saving <pid>" and train on until
the test kills it."""

from __future__ import annotations

import os
import sys
import time

import torch
from accelerate.utils import ProjectConfiguration
from fault_helpers import BATCH, SEQ, VOCAB, tiny_model

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.optim import HybridAdamW8bit

#: ~4 s for the tiny model's ~0.2 MB checkpoint: a window to kill it in.
SLOW_WRITE_BYTES_PER_S = 50_000.0


def run(project_dir: str) -> None:
    torch.set_num_threads(1)
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    plugin = LazyTrainPlugin(plan="megatrain", hardware="h800",
                             checkpoint_max_shard_bytes=60_000,
                             cache_dir=f"{project_dir}/cache", nvme_dir=f"{project_dir}/nvme")
    acc = Accelerator(cpu=True, plugin=plugin, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=1))
    model, opt = acc.prepare(model, HybridAdamW8bit(model.parameters(), lr=1e-2))
    for step in range(10**6):
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        if step == 0:
            acc.save_state()
            acc.lazytrain_wait_for_checkpoint()  # checkpoint_0: published
        elif step == 1:
            acc.lazytrain_plugin.checkpoint_write_bytes_per_s = SLOW_WRITE_BYTES_PER_S
            acc.save_state()  # checkpoint_1: being written when the kill comes
            print(f"saving {os.getpid()}", flush=True)
        time.sleep(0.05)  # leave the shared cores to the other runs


def main(directory: str, count: int) -> None:
    children = []
    for i in range(count):
        pid = os.fork()
        if pid == 0:
            try:
                run(f"{directory}/run{i}")
            finally:
                os._exit(1)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
