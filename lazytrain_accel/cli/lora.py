"""The LoRA / QLoRA flags of `plan`, `simulate`, `max-batch` and `profile`, as a profile's
adapted geometry and `WeightSplit` (see `profiling/adapters.py`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lazytrain_accel.cli import CliError
from lazytrain_accel.profiling.adapters import ALL_LINEAR, lora_profile_inputs
from lazytrain_accel.profiling.model_configs import COMPUTE_DTYPE_BYTES
from lazytrain_accel.profiling.profile import ModelGeometry, WeightSplit


def _adapter_config(path: str) -> tuple[int, list[str]]:
    """(r, target_modules) of a PEFT `adapter_config.json` / LoraConfig JSON."""
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CliError(f"--adapter-config {path!r}: cannot read a JSON object ({err})",
                       exit_code=2) from None
    rank, targets = data.get("r") if isinstance(data, dict) else None, None
    if isinstance(data, dict):
        targets = data.get("target_modules")
    if not isinstance(rank, int) or rank < 1:
        raise CliError(f"--adapter-config {path!r} has no positive integer `r`; give a PEFT "
                       "LoraConfig JSON (adapter_config.json)", exit_code=2)
    if isinstance(targets, str):
        targets = [targets]
    return rank, list(targets or [ALL_LINEAR])


def lora_weights(geometry: ModelGeometry, args: argparse.Namespace
                 ) -> tuple[ModelGeometry, WeightSplit | None]:
    """`geometry` with adapters and its split when the flags ask for LoRA, else as is."""
    rank, targets = args.lora_rank, args.lora_targets
    if args.adapter_config:
        if rank is not None or targets is not None:
            raise CliError("give either --adapter-config or --lora-rank/--lora-targets, not "
                           "both", exit_code=2)
        rank, targets = _adapter_config(args.adapter_config)
    if rank is None:
        if args.frozen_format is not None or targets is not None:
            raise CliError("--frozen-format and --lora-targets describe a LoRA run: add "
                           "--lora-rank R (or --adapter-config)", exit_code=2)
        return geometry, None
    try:
        return lora_profile_inputs(geometry, rank=rank, targets=targets or [ALL_LINEAR],
                                   frozen_format=args.frozen_format or args.dtype,
                                   compute_bytes_per_elem=COMPUTE_DTYPE_BYTES[args.dtype])
    except ValueError as err:
        raise CliError(str(err), exit_code=2) from None
