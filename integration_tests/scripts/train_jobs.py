"""Two-rank training jobs under the node store, for killing mid-step and mid-save (issues
30 and 33).

This process imports torch, transformers, accelerate and the package once (a full
`accelerate launch` pays that per rank, ~20 s of two loaded cores a launch), then for each
line `DIR PORT MODE` on stdin forks a job and prints its pid: a launcher in a session of
its own that forks two ranks, each in a session of its own (torch's launcher does the
same) with the environment torchrun gives them, and waits for them. Nothing here cleans
up: what a kill leaves is what a job leaves.

Each rank runs a user's loop (a Qwen2 of ~85 MB of fp32 masters, enough to show in
`Shmem` if the store leaked; hybrid 8-bit AdamW, the layer-wise update split between the
ranks) under accelerate's automatic checkpoint naming in DIR (`total_limit=2`):
- it resumes with `load_state()` when DIR holds a checkpoint, then checks that the masters
  it owns are the ones a pre-hook of that checkpoint's `save_state` recorded (the sha256
  of each in `DIR/digest-<iteration>-<rank>`, taken at the save's step before its writer
  starts), and writes `DIR/resumed-<rank>`: {"iteration": loaded, "differ": [names]};
- a job that finds no checkpoint trains a step and publishes checkpoint_0 first.
MODE `save`: every step ends in an asynchronous save with a throttled writer (each save
waits for the one before), so the job is always saving; rank 0 touches `DIR/saving` once
the first has started. MODE `step`: no saves, the segment in /dev/shm (`node_store_dir`: a
file created there and unlinked at once) instead of memfd; rank 0 writes the number of the
step it starts to `DIR/steps`. A rank that fails writes its traceback to
`DIR/failed-<rank>`.
"""

from __future__ import annotations

import hashlib
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import ProjectConfiguration
from job_server import serve_jobs
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.checkpoints import resume
from lazytrain_accel.checkpoints import share_format as sc
from lazytrain_accel.optim import native

#: Each rank writes ~65 MB of a checkpoint: ~1.5 s a save at this rate.
SAVE_BYTES_PER_S = 45e6
BATCH, SEQ, VOCAB = 2, 8, 128


class Progress:
    """Which checkpoint this is (saved with it by stock `save_state` as a custom object)."""

    def __init__(self) -> None:
        self.iteration = -1

    def state_dict(self) -> dict[str, int]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.iteration = state["iteration"]


def write_atomically(path: Path, text: str) -> None:
    """`text` in `path`, whole or not at all (the test may read it while a kill comes)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def owned_digests(accelerator: Any) -> dict[str, str]:
    """sha256 of each master this rank's update owns (the only ones it may read while the
    other rank updates its own), by name."""
    state = accelerator.lazytrain
    names = sc.param_names(state.model)
    owned = resume.owned_params(state.engine) or list(names)
    return {names[p]: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8)
                                     .numpy().tobytes()).hexdigest() for p in owned}


def train(directory: Path, rank: int, mode: str) -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=768, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False))
    plugin = LazyTrainPlugin(
        plan="offload_all", hardware="h800", cache_dir=str(directory.parent / "cache"),
        nvme_dir=str(directory / f"nvme-{rank}"),
        node_store_dir="/dev/shm" if mode == "step" else "memfd")
    accelerator = Accelerator(cpu=True, plugin=plugin, project_config=ProjectConfiguration(
        project_dir=str(directory), automatic_checkpoint_naming=True, total_limit=2))
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    model, optimizer = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def record(*_: Any) -> None:  # save_state's pre-hook: at the save's step
        write_atomically(directory / f"digest-{progress.iteration}-{rank}",
                         json.dumps(owned_digests(accelerator)))

    accelerator.register_save_state_pre_hook(record)

    def save() -> None:
        progress.iteration = accelerator.save_iteration
        accelerator.save_state()

    def step(number: int) -> None:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ),
                            generator=torch.Generator().manual_seed(2 * number + rank))
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()

    if any((directory / "checkpoints").glob("checkpoint_*")):
        accelerator.load_state()  # the latest checkpoint
        accelerator.project_configuration.iteration = progress.iteration + 1
        recorded = json.loads((directory / f"digest-{progress.iteration}-{rank}").read_text())
        loaded = owned_digests(accelerator)
        differ = sorted(n for n in recorded.keys() | loaded.keys()
                        if recorded.get(n) != loaded.get(n))
        write_atomically(directory / f"resumed-{rank}",
                         json.dumps({"iteration": progress.iteration, "differ": differ}))
    else:
        step(0)
        save()
        accelerator.lazytrain_wait_for_checkpoint()  # checkpoint_0: published
    if mode == "save":
        accelerator.lazytrain_plugin.checkpoint_write_bytes_per_s = SAVE_BYTES_PER_S
    for number in range(1, 10**6):
        if mode == "step" and rank == 0:
            write_atomically(directory / "steps", str(number))
        step(number)
        if mode == "save":
            save()
            if number == 1 and rank == 0:
                (directory / "saving").touch()


def rank_main(directory: Path, port: str, mode: str, rank: int) -> None:
    """One rank: a session of its own, torchrun's environment, output to `DIR/log-<rank>`."""
    os.setsid()
    log = os.open(directory / f"log-{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": f"crash-{port}",
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a rank torchrun starts
    try:
        train(directory, rank, mode)
    except BaseException:
        write_atomically(directory / f"failed-{rank}", traceback.format_exc())
    finally:
        os._exit(1)


def launch(directory: Path, port: str, mode: str) -> None:
    """The launcher: two ranks, waited for."""
    os.setsid()
    ranks = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            rank_main(directory, port, mode, rank)
        ranks.append(pid)
    for pid in ranks:
        os.waitpid(pid, 0)


def main() -> None:
    native.load_kernel()  # loaded once here, not by each rank of each job (no thread starts)

    def job(words: list[str]) -> None:
        directory, port, mode = words
        Path(directory).mkdir(parents=True, exist_ok=True)
        launch(Path(directory), port, mode)

    serve_jobs(job)


if __name__ == "__main__":
    main()
