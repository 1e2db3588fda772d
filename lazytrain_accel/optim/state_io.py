"""Loading HybridAdamW8bit state: keep the uint8 codes uint8, and check shapes.

`torch.optim.Optimizer.load_state_dict` casts every floating-point parameter's state
tensors to the parameter's dtype, which would turn 1-byte codes into 4-byte floats. The
codes are set aside, the rest goes through torch's loader (param-id remapping, device
moves, hooks), and the codes are put back on the parameter's device as uint8.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from lazytrain_accel.optim.codes import num_blocks

CODE_KEYS = ("exp_avg_codes", "exp_avg_sq_codes")
ABSMAX_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")


def load_state_keeping_codes(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """Run torch's `load` on `state_dict` without the codes, then restore them."""
    codes: dict[Any, dict[str, torch.Tensor]] = {}
    stripped: dict[Any, dict[str, Any]] = {}
    for key, state in state_dict["state"].items():
        stripped[key] = {k: v for k, v in state.items() if k not in CODE_KEYS}
        codes[key] = {k: state[k] for k in CODE_KEYS if k in state}
    load({**state_dict, "state": stripped})
    saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    for saved_id, param in zip(saved_ids, params, strict=True):
        for name, value in codes.get(saved_id, {}).items():
            optimizer.state[param][name] = value.to(
                device=param.device, dtype=torch.uint8, copy=True
            )


def check_loaded_state(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError if any loaded state does not fit its parameter and block size."""
    for index, (group, param) in enumerate(
        (g, p) for g in optimizer.param_groups for p in g["params"]
    ):
        state = optimizer.state.get(param)
        if not state:
            continue
        where = f"parameter #{index} (shape {tuple(param.shape)})"
        if "exp_avg" in state:
            if state["exp_avg"].shape != param.shape:
                raise ValueError(f"{where}: exp_avg has shape {tuple(state['exp_avg'].shape)}; "
                                 "the state_dict comes from a different model")
            continue
        missing = [k for k in (*CODE_KEYS, *ABSMAX_KEYS) if k not in state]
        if missing:
            raise ValueError(f"{where}: state lacks {missing}; was it saved by HybridAdamW8bit?")
        blocks = num_blocks(param.numel(), group["block_size"])
        for name in CODE_KEYS:
            if state[name].numel() != param.numel():
                raise ValueError(f"{where}: {name} has {state[name].numel()} codes for "
                                 f"{param.numel()} elements; the state_dict comes from a "
                                 "different model")
        for name in ABSMAX_KEYS:
            if state[name].numel() != blocks:
                raise ValueError(f"{where}: {name} has {state[name].numel()} blocks, expected "
                                 f"{blocks} at block_size={group['block_size']}; load it with "
                                 "the block_size it was saved with")
