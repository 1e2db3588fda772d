"""A user-style Accelerate training script, as people write them, with one LazyTrain line.

Tiny Qwen2 from a config, synthetic token data, AdamW, a linear LR schedule, gradient
accumulation, clipping. Writes the per-step losses to --losses (JSON) so tests can compare
runs launched in different ways: each step's loss is the mean over the global batch (the
ranks' mean of their micro-batches' mean; `mean_loss`), so N ranks of batch B log what
one process accumulating N micro-batches of B logs, and `--samples-out` writes which
sequences (their first token) each step trained on, in rank then micro-batch order. The
learning-rate schedule counts optimizer steps whatever the world size (`linear_decay`).
`--poison-rank R --poison-step S` makes rank R's loss
infinite at step S (a local overflow); `--kill-rank R --kill-step S` kills rank R
(SIGKILL) after its backward of step S (the time in <losses>.killed_at), or with
`--kill-when exchange` (the split layout over nodes) once its update of step S has started
sending its first group's new weights to the other nodes; `--state-out`
writes each rank's final weights checksum, learning rate, skipped-step count and the
plan's node shape; `--pss-out` each rank's proportional set size
(/proc/self/smaps_rollup) with the runtime loaded and no model yet ("runtime": the
Accelerator, its process group and a data loader's prepare come first in that mode), just
before `prepare` (model built) and after training, and the engine's device bytes then
(on a CPU device, host pages that stand for GPU memory). `--progress-out` has rank 0
write its finished steps after each, `--slow-save-s S` makes `save_state` take S seconds
more (after touching <losses>.saving): a test kills the job there. `--net-out` (simulated
nodes) writes each rank's TCP bytes sent to other nodes' ranks after each step.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DataLoaderConfiguration, set_seed
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel import Accelerator, LazyTrainPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from net_bytes import available, bytes_sent_to  # this directory (the script's own)
from peak_rss import pss_bytes  # bench/ is not a package

#: A run takes ~10 s: past this a rank is hung; it prints every thread's stack and exits
#: 1, so the launching test fails with where it hung instead of at its own timeout.
HANG_DUMP_S = 240


def build_data(num_samples: int, seq_len: int, vocab: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    # A learnable pattern: each sequence counts upward from a random start (mod vocab).
    start = torch.randint(0, vocab, (num_samples, 1), generator=g)
    ids = (start + torch.arange(seq_len)) % vocab
    return torch.utils.data.TensorDataset(ids)


def digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            values: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of the weights' bytes (`values`: the model's state dict, as
    `accelerator.get_state_dict` gathers it) and of this rank's optimizer state (by
    name)."""
    weights, state = hashlib.sha256(), hashlib.sha256()
    names = {p: n for n, p in model.named_parameters()}
    for name, _ in model.named_parameters():
        weights.update(name.encode() + values[name].detach().contiguous().view(-1)
                       .view(torch.uint8).numpy().tobytes())
    inner = getattr(optimizer, "optimizer", optimizer)
    for p, entry in sorted(inner.state.items(), key=lambda item: names[item[0]]):
        for key in sorted(entry):
            value = entry[key]
            raw = (value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                   if isinstance(value, torch.Tensor) else repr(value).encode())
            state.update(f"{names[p]}/{key}".encode() + raw)
    return {"weights": weights.hexdigest(), "state": state.hexdigest(),
            "state_params": str(len(inner.state)),
            "lr": repr(inner.param_groups[0]["lr"])}


def cpus_allowed() -> list[str]:
    """`Cpus_allowed_list` of every thread of this process (/proc/<pid>/task/*/status),
    deduplicated: one entry when the compute and update threads share one binding."""
    lists = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        lists.update(line.split(":", 1)[1].strip() for line in status.splitlines()
                     if line.startswith("Cpus_allowed_list:"))
    return sorted(lists)


def mean_loss(micro_losses: list[torch.Tensor]) -> torch.Tensor:
    """The mean of one optimizer step's micro-batch losses, summed in order then divided:
    with 2 micro-batches the very value 2 ranks' `reduce(loss, "mean")` gives
    ((l0 + l1) / 2, addition being commutative); with 4 gloo may add in another order."""
    total = micro_losses[0]
    for loss in micro_losses[1:]:
        total = total + loss
    return total / len(micro_losses)


def linear_decay(processes: int) -> Callable[[int], float]:
    """1 - step / 100 per optimizer step. A prepared scheduler is stepped once per
    process at each optimizer step (accelerate's convention, split_batches=False), so N
    ranks count N per step: N * k / (100 * N) is the same double as k / 100, and N ranks
    follow the one-process schedule bit for bit."""
    return lambda count: 1.0 - count / (100 * processes)


def slow_save(args: argparse.Namespace) -> None:
    """A save_state pre-hook: mark that a save runs, then take `--slow-save-s` in it."""
    Path(f"{args.losses}.saving").touch()
    time.sleep(args.slow_save_s)


def kill_self(args: argparse.Namespace) -> None:
    """SIGKILL this process, its time in <losses>.killed_at first."""
    with open(f"{args.losses}.killed_at", "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def kill_when_sending(args: argparse.Namespace, step_now: Callable[[], int]) -> None:
    """Kill this rank (`--kill-when exchange`) once `NodeExchange.start` has started
    sending a group's new weights from step `--kill-step` on (on the update's thread,
    which may run beside the next step's forward): the other nodes are receiving them."""
    from lazytrain_accel.distributed.node_exchange import NodeExchange

    start = NodeExchange.start

    def start_then_die(self: NodeExchange, group: int, params: Any, copy: Any = None) -> Any:
        exchange = start(self, group, params, copy)
        if exchange is not None and self.sends(group) and step_now() >= args.kill_step:
            kill_self(args)
        return exchange

    NodeExchange.start = start_then_die


def make_accelerator(args: argparse.Namespace, plugin: LazyTrainPlugin | None
                     ) -> Accelerator:
    # A seedable sampler makes the data order a function of (seed, epoch), so a resumed
    # run can skip the batches it already saw and see the same ones after.
    return Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.grad_accum,
                       mixed_precision=args.mixed_precision,
                       dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
                       plugin=plugin)


def write_progress(accelerator: Any, ckpt_dir: str, step: int) -> None:
    """The script's own file in the checkpoint (rank 0). An async save publishes the
    folder later: wait before adding a file to it (docs/user_guide.md "Checkpoints")."""
    if accelerator.is_main_process:
        wait = getattr(accelerator, "lazytrain_wait_for_checkpoint", None)
        if wait is not None:
            wait()
        with open(ckpt_dir + "/progress.json", "w") as f:
            json.dump({"step": step}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lazytrain", action="store_true")
    p.add_argument("--verbose", action="store_true", help="the plugin's INFO lines")
    p.add_argument("--plan", default=None)
    p.add_argument("--optimizer", default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--resume-from", default=None)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--losses", required=True)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--poison-rank", type=int, default=None)
    p.add_argument("--poison-step", type=int, default=None)
    p.add_argument("--state-out", default=None, help="per-rank JSON file prefix")
    p.add_argument("--pss-out", default=None, help="per-rank JSON file prefix")
    p.add_argument("--mixed-precision", default="no", help="the Accelerator's (bf16: "
                   "the engine streams bf16 compute copies)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kill-rank", type=int, default=None, help="SIGKILL itself mid-step")
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--kill-when", choices=("backward", "exchange"), default="backward")
    p.add_argument("--masters-out", default=None, help="rank 0's masters at --save-at")
    p.add_argument("--digest-out", default=None, help="per-rank JSON file prefix")
    p.add_argument("--net-out", default=None, help="per-rank JSON file prefix: TCP bytes "
                   "sent to the other nodes' ranks after each step (net_bytes.py)")
    p.add_argument("--samples-out", default=None, help="each step's sequences (JSON)")
    p.add_argument("--progress-out", default=None, help="rank 0's finished steps so far")
    p.add_argument("--slow-save-s", type=float, default=0.0,
                   help="sleep inside save_state (<losses>.saving marks it) to be killed there")
    p.add_argument("--finish-save-at-end", action="store_true",
                   help="train on while an async save is written; its progress.json last")
    args = p.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    faulthandler.dump_traceback_later(HANG_DUMP_S, exit=True)

    set_seed(0)
    plugin = None
    if args.lazytrain:
        kwargs = {k: v for k, v in (("plan", args.plan), ("optimizer", args.optimizer)) if v}
        plugin = LazyTrainPlugin(**kwargs)
    data = build_data(64, 16, 128)
    accelerator = pss_runtime = None
    if args.pss_out:  # the runtime first, then the model: a multi-process loader's prepare
        # adds ~60 MB of PSS per rank (measured, CPU, gloo), which is no training state
        accelerator = make_accelerator(args, plugin)
        accelerator.prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=2))
        pss_runtime = pss_bytes()
    set_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=args.hidden_size,
                         intermediate_size=2 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    accelerator = accelerator or make_accelerator(args, plugin)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  linear_decay(accelerator.num_processes))
    pss_before_prepare = pss_bytes()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    if args.resume_from:
        accelerator.load_state(args.resume_from)
    if args.slow_save_s:
        accelerator.register_save_state_pre_hook(lambda *_: slow_save(args))
    losses: list[float] = []
    micro_losses: list[torch.Tensor] = []
    samples: list[list[int]] = []  # per step: each sequence's first token
    step = 0
    if args.kill_rank == accelerator.process_index and args.kill_when == "exchange":
        kill_when_sending(args, lambda: step)
    skip_batches = 0
    net = None
    if args.net_out and available():  # each rank's pid and node: whose sockets leave it
        places: list[Any] = [None] * accelerator.num_processes
        torch.distributed.all_gather_object(places, (os.getpid(), os.environ["GROUP_RANK"]))
        node = os.environ["GROUP_RANK"]
        net = {"node": node, "sent": [], "params": sum(
            q.numel() for q in model.parameters() if q.requires_grad),
            "others": {pid for pid, where in places if where != node}}
    if args.resume_from:
        with open(args.resume_from + "/progress.json") as f:
            step = json.load(f)["step"]
        skip_batches = step * args.grad_accum
    epoch_loader = (accelerator.skip_first_batches(loader, skip_batches) if skip_batches
                    else loader)
    while step < args.steps:
        for (ids,) in epoch_loader:
            with accelerator.accumulate(model):
                out = model(input_ids=ids, labels=ids)
                poisoned = (accelerator.process_index == args.poison_rank
                            and step == args.poison_step)
                accelerator.backward(out.loss * (float("inf") if poisoned else 1.0))
                if (accelerator.process_index == args.kill_rank and step == args.kill_step
                        and args.kill_when == "backward"):
                    kill_self(args)  # between backward and update
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            micro_losses.append(out.loss.detach())
            if args.samples_out:
                if len(micro_losses) == 1:  # the step's first micro-batch
                    samples.append([])
                samples[-1].extend(accelerator.gather(ids[:, 0]).tolist())
            if accelerator.sync_gradients:
                losses.append(float(accelerator.reduce(mean_loss(micro_losses),
                                                       reduction="mean")))
                micro_losses.clear()
                step += 1
                if net is not None:  # the step's collectives are done on every rank
                    accelerator.wait_for_everyone()
                    net["sent"].append(bytes_sent_to(os.getpid(), net["others"]))
                if args.progress_out and accelerator.is_main_process:
                    Path(args.progress_out).write_text(str(step))
                if args.save_at is not None and step == args.save_at:
                    accelerator.save_state(args.ckpt_dir)
                    if args.masters_out:  # every rank: a collective under split bf16
                        at_save = accelerator.get_state_dict(model)
                        if accelerator.is_main_process:
                            torch.save({n: at_save[n].detach().clone()
                                        for n, _ in model.named_parameters()},
                                       args.masters_out)
                    if not args.finish_save_at_end:
                        write_progress(accelerator, args.ckpt_dir, step)
                if step >= args.steps:
                    break
        epoch_loader = loader
    if args.finish_save_at_end and args.save_at is not None:
        write_progress(accelerator, args.ckpt_dir, args.save_at)
    if accelerator.is_main_process:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
        if args.samples_out:
            with open(args.samples_out, "w") as f:
                json.dump(samples, f)
    pss_end = 0
    if args.pss_out:  # the training state, before the state dict below copies weights
        accelerator.wait_for_everyone()
        pss_end = pss_bytes()
    # every rank (a collective under the split layout below fp32 compute, whose nodes
    # hold the layers others update as their compute copy alone)
    values = accelerator.get_state_dict(model) if args.state_out or args.digest_out else {}
    if args.state_out:
        accelerator.wait_for_everyone()  # a running layer-wise update has ended
        with open(f"{args.state_out}{accelerator.process_index}.json", "w") as f:
            json.dump({"weights_sum": sum(float(values[n].detach().double().sum())
                                       for n, _ in model.named_parameters()),
                       "lr": scheduler.get_last_lr()[0],
                       "skipped": accelerator.lazytrain.guard.skipped_steps
                       if args.lazytrain else None,
                       "gpus_per_node": accelerator.lazytrain.run.plan.gpus_per_node
                       if args.lazytrain else None,
                       "cpus_allowed": cpus_allowed(), "threads": torch.get_num_threads()},
                      f)
    if net is not None:
        with open(f"{args.net_out}{accelerator.process_index}.json", "w") as f:
            json.dump({k: v for k, v in net.items() if k != "others"}, f)
    if args.digest_out:
        accelerator.wait_for_everyone()
        with open(f"{args.digest_out}{accelerator.process_index}.json", "w") as f:
            json.dump(digests(model, optimizer, values), f)
    if args.pss_out:
        with open(f"{args.pss_out}{accelerator.process_index}.json", "w") as f:
            engine = accelerator.lazytrain.engine if args.lazytrain else None
            json.dump({"runtime": pss_runtime, "before_prepare": pss_before_prepare,
                       "end": pss_end,
                       # on a CPU device the engine's "device" buffers (its weight slots)
                       # are host pages standing for GPU memory
                       "device": engine.stats().current_bytes["device"]
                       if engine is not None and engine.device.type == "cpu" else 0}, f)
    # All ranks reach the process-group teardown together: a rank still tearing down
    # after rank 0 (which hosts the rendezvous store) has exited can wait forever.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if not args.lazytrain and accelerator.num_processes > 1:
        # The stock reference run: everything it reports is written. Its gloo teardown
        # after the process group is destroyed can still wait forever for rank 0's store
        # (seen once in CI: rank 1 stuck 240 s after `main` returned, on the plugin-less
        # path, no engine attached), so it leaves without one. LazyTrain runs exit
        # normally: their exit (pending saves, the update thread) is what
        # test_thread_exit.py checks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
