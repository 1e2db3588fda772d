"""`lazytrain demo`: fine-tune a small model end to end and show what the plan did."""

from __future__ import annotations

import argparse

from lazytrain_accel.cli import CliError, help_of
from lazytrain_accel.cli.args import non_negative_int, positive_int

_SETTINGS = ("model", "dataset", "steps", "batch_size", "seq_len", "lr", "output_dir", "plan",
             "hardware", "nvme_dir", "gpu_memory_gb", "eval_count", "seed", "loss_chunk_tokens")


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    p = subparsers.add_parser(
        name, help=help_of(name),
        description="Profile, plan, stream, train, evaluate (exact match before/after) and "
        "save a checkpoint, the plan, a timeline PNG and Chrome traces. With no flags it "
        "runs the built-in demo model on the bundled arithmetic word problems. --plan, --hardware, "
        "--nvme-dir, --gpu-memory-gb and --loss-chunk-tokens left out take their LAZYTRAIN_* "
        "variable when it is set.")
    p.add_argument("--model", help="local HF model directory (config, weights, tokenizer); "
                   "default: the built-in 8-layer demo Qwen2")
    p.add_argument("--dataset", help="MetaMathQA-form JSONL ({query, response} ending in "
                   "'The answer is: N'); default: the bundled word problems")
    p.add_argument("--steps", type=positive_int, help="optimizer steps (default 300)")
    p.add_argument("--batch-size", type=positive_int, help="micro-batch size (default 32)")
    p.add_argument("--seq-len", type=positive_int,
                   help="tokens per example, padded or cut (default 48)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    p.add_argument("--output-dir",
                   help="where the checkpoint, plan, timeline and traces go "
                   "(default ./lazytrain_output)")
    p.add_argument("--plan", help="'auto' (solve the MIP), a strategy name, "
                   "or a plan JSON from `lazytrain plan --output`")
    p.add_argument("--hardware", help="'auto' (measure this machine, cached), "
                   "a preset name or a hardware JSON")
    p.add_argument("--nvme-dir", help="directory for boundaries the plan puts on NVMe")
    p.add_argument("--gpu-memory-gb", type=float,
                   help="device budget to plan for, GiB; default: a budget that holds about "
                   "a third of the boundaries, so the plan offloads; 0 = the whole device")
    p.add_argument("--eval-count", type=positive_int,
                   help="held-out problems for exact match (default 200)")
    p.add_argument("--seed", type=int, help="seed of weights and data order")
    p.add_argument("--loss-chunk-tokens", type=_loss_chunk, metavar="auto|N",
                   help="the loss head (LazyTrainConfig.loss_chunk_tokens): 'auto' lets the "
                   "planner turn the fused chunked loss on where the full logits would cost "
                   "memory or speed; N = the fused loss with N tokens of logits at a time; "
                   "0 = the model's own loss (default: LAZYTRAIN_LOSS_CHUNK_TOKENS, else "
                   "'auto')")


def _loss_chunk(text: str) -> int | str:
    """argparse type of the demo's `--loss-chunk-tokens`: 'auto' (kept: it beats the
    environment like any given flag) or N >= 0."""
    return "auto" if text.strip().lower() == "auto" else non_negative_int(text)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lazytrain_accel.demo.run import DemoSettings, run_demo

    # Flags left out keep DemoSettings' defaults (the help texts quote them).
    given = {name: getattr(args, name) for name in _SETTINGS if getattr(args, name) is not None}
    try:
        settings = DemoSettings(**given)
    except ValueError as err:
        raise CliError(str(err), exit_code=2) from None
    console = Console(soft_wrap=True)  # a log line stays one line, whatever the width
    try:
        result = run_demo(settings, console)
    except ValueError as err:  # bad inputs, infeasible plans, preflight: one paragraph
        raise CliError(str(err), exit_code=2) from None
    except OSError as err:  # a failure while running (disk full, I/O error)
        raise CliError(str(err)) from None
    console.print(
        f"exact match {result.exact_match_before:.1%} -> [bold]{result.exact_match_after:.1%}"
        f"[/bold] on {result.eval_problems} held-out problems; {result.train.steps} steps at "
        f"{result.train.tokens_per_s:,.0f} tok/s; wall {result.wall_s:.0f} s")
    for what, path in result.files.items():
        console.print(f"  {what:16s} {path}")
    return 0
