"""Runs examples/train_clm.py in this process, for what a test cannot see from outside:

    python run_clm.py [--stop-at-save] [--logits-out PATH] -- EXAMPLE ARGS...

--stop-at-save: exit (status 3) right after the first checkpoint is written, as a crash
    or a preempted job would; --kill-in-second-save: SIGKILL this process in the middle of
    writing the second checkpoint (after its weights, before its RNG and trainer state);
    --logits-out: after training, save the logits of the trained
    in-memory model (still attached to the engine) on fixed token ids, with those ids.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_clm.py"
STOPPED_AT_SAVE = 3


class StopAtSave(TrainerCallback):
    def on_save(self, args: object, state: object, control: object, **kwargs: object) -> None:
        sys.stdout.flush()
        raise SystemExit(STOPPED_AT_SAVE)


def _kill_in_second_save() -> None:
    from transformers import Trainer

    stock = Trainer._save_rng_state
    calls = []

    def save_rng_state(self: Trainer, output_dir: str) -> None:
        calls.append(output_dir)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        stock(self, output_dir)

    Trainer._save_rng_state = save_rng_state


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser()
    p.add_argument("--stop-at-save", action="store_true")
    p.add_argument("--logits-out", default=None)
    p.add_argument("--kill-in-second-save", action="store_true")
    args = p.parse_args(argv[:split])
    if args.kill_in_second_save:
        _kill_in_second_save()
    example = runpy.run_path(str(EXAMPLE), run_name="train_clm")
    callbacks = [StopAtSave()] if args.stop_at_save else []
    trainer = example["main"](argv[split + 1:], callbacks=callbacks)
    if args.logits_out and trainer.is_world_process_zero():
        vocab = trainer.model.config.vocab_size
        ids = torch.arange(24).reshape(2, 12) * 7 % vocab
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits.float().cpu()
        torch.save({"input_ids": ids, "logits": logits}, args.logits_out)


if __name__ == "__main__":
    main()
