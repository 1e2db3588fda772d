"""Flag types and flags several subcommands share, so a bad value reads the same in all.

Light on purpose (argparse only): every subcommand's parser imports it.
"""

from __future__ import annotations

import argparse
from typing import Any

#: Flags of the planning commands (dest) and the `LazyTrainConfig` field whose
#: `LAZYTRAIN_*` variable fills them when the flag is left out.
ENV_FILLED = {"hardware": "hardware", "time_limit_s": "solver_time_limit_s",
              "max_recompute_block": "max_recompute_block",
              "gpu_memory_gb": "gpu_memory_limit_gb", "cpu_memory_gb": "cpu_memory_limit_gb",
              "nvme_gb": "nvme_limit_gb", "loss_chunk_tokens": "loss_chunk_tokens",
              "resident_update": "resident_update"}


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """argparse type of counts and sizes (`--batch-size`, `--seq-len`, `--steps`): >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type of settings where 0 means "off" (`--loss-chunk-tokens`): >= 0."""
    return _int_at_least(text, 0)


def loss_chunk_or_auto(text: str) -> int | None:
    """argparse type of `--loss-chunk-tokens` where the planner may decide: 'auto' -> None."""
    return None if text.strip().lower() == "auto" else non_negative_int(text)


def add_loss_chunk_arg(p: argparse.ArgumentParser, *, default: int | None = 0,
                       allow_auto: bool = False) -> None:
    """`--loss-chunk-tokens`: the head's working bytes the planner counts. With
    `allow_auto`, 'auto' (None, the default there) lets the planner decide."""
    if allow_auto:
        p.add_argument("--loss-chunk-tokens", type=loss_chunk_or_auto, default=default,
                       metavar="auto|N",
                       help="the loss head (LazyTrainConfig.loss_chunk_tokens): 'auto' lets the "
                       "planner turn the fused chunked loss on where the full logits would cost "
                       "memory or speed (default); N = the fused loss with N tokens of logits "
                       "at a time; 0 = the model's own loss, full tokens x vocab logits")
        return
    shown = "" if default is None else f" (default {default})"
    p.add_argument("--loss-chunk-tokens", type=non_negative_int, default=default, metavar="N",
                   help="the fused chunked loss with N tokens of logits at a time "
                   "(LazyTrainConfig.loss_chunk_tokens); 0 = the model's own loss, full "
                   f"tokens x vocab logits{shown}")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """`--lora-rank`, `--lora-targets`, `--frozen-format`, `--adapter-config`: plan a LoRA or
    QLoRA run (adapters trainable, base frozen and maybe packed) from a config alone."""
    p.add_argument("--lora-rank", type=positive_int, metavar="R",
                   help="plan LoRA adapters of rank R (PEFT's r) on a frozen base: only the "
                   "adapters get gradients, optimizer state and host updates")
    p.add_argument("--lora-targets", nargs="+", metavar="NAME", default=None,
                   help="linears the adapters wrap (q_proj k_proj v_proj o_proj gate_proj "
                   "up_proj down_proj, or all-linear: the default)")
    p.add_argument("--frozen-format", choices=("nf4", "fp4", "int8", "bf16", "fp16", "fp32"),
                   default=None, help="how the frozen base's linears are stored (bitsandbytes "
                   "nf4/fp4 4-bit or LLM.int8, or a dtype); with --lora-rank only (default: "
                   "the --dtype)")
    p.add_argument("--adapter-config", metavar="adapter_config.json",
                   help="a PEFT LoraConfig JSON giving r and target_modules (instead of "
                   "--lora-rank and --lora-targets)")


def fill_from_environment(args: argparse.Namespace) -> None:
    """Flags left out (None) take their `LAZYTRAIN_*` variable, else the config's default:
    a flag the user did not give never overrides the environment."""
    from lazytrain_accel.config import env_setting

    for dest, field in ENV_FILLED.items():
        if hasattr(args, dest) and getattr(args, dest) is None:
            value: Any = env_setting(field)
            setattr(args, dest, None if value == "auto" and dest == "loss_chunk_tokens"
                    else value)


def add_node_args(p: argparse.ArgumentParser) -> None:
    """`--gpus-per-node`, `--nodes`: plan one rank of a node whose GPUs share one host copy
    of the state (planning/node.py); the host budget is then the node's."""
    p.add_argument("--gpus-per-node", type=positive_int, default=1, metavar="N",
                   help="local ranks (GPUs) sharing one host: the masters, optimizer state "
                   "and compute copies are held once per node, each rank's staging and "
                   "host-homed boundaries N times, and the GPUs share the host memory "
                   "bandwidth (default 1)")
    p.add_argument("--nodes", type=positive_int, default=1, metavar="K",
                   help="nodes of --gpus-per-node GPUs each; the job's tokens/s is K times "
                   "a node's (default 1)")
