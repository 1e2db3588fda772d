"""Resuming from a share checkpoint: the one load path (`load_share_checkpoint`).

Each rank loads the masters and the optimizer state of the parameters it owns
(`owned_params`: its update groups under a split update, else all), from whichever share
file the manifest names, so a checkpoint of N ranks re-shards onto any M; the layout hash
must match. A stock checkpoint (no manifest: `optimizer.bin` or the Trainer's
`optimizer.pt`) loads as one share. What the callers differ in is a parameter: whether
the weights load too (`load_state`) and whether missing optimizer state is refused (the
Trainer's resume). Docs: docs/user_guide.md "8. Checkpoints".
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lazytrain_accel.checkpoints.layout import WEIGHTS, weight_files
from lazytrain_accel.checkpoints.publication import rank_and_world
from lazytrain_accel.checkpoints.share_format import (
    MANIFEST,
    MASTER_KEY,
    STOCK_OPTIMIZER,
    check_layout,
    decode_value,
    name_of,
    param_names,
    read_share,
)

if TYPE_CHECKING:
    from lazytrain_accel.engine import StreamingEngine

logger = logging.getLogger("lazytrain_accel")


def owned_params(engine: StreamingEngine | None, *, updated: bool = False
                 ) -> list[nn.Parameter] | None:
    """The parameters of the groups this rank owns in a split update (groups every rank
    owns included; `updated`: only those it updates, not those another node updates and
    sends it under the split layout); None without one (this rank holds and updates
    everything)."""
    peers = engine.steps.peers if engine is not None else None
    if peers is None:
        return None
    remote = engine.steps.remote if updated else None
    return [p for g, ps in enumerate(engine.steps.update_groups) if peers.owns(g)
            and (remote is None or not remote.is_remote(g)) for p in ps]


def load_share_checkpoint(directory: Path, manifest: Mapping[str, Any] | None, *,
                          model: nn.Module, optimizer: torch.optim.Optimizer | None,
                          engine: StreamingEngine | None, weights: bool,
                          stock_optimizer: str = STOCK_OPTIMIZER,
                          require_optimizer: bool = False) -> None:
    """Load this rank's part of a share checkpoint (`manifest`) or of a stock one (None):
    with `weights`, the weights this rank loads (every rank then waits for every owner's
    masters), and the optimizer state of the parameters it owns and updates (with
    `MASTER_KEY`, their exact masters). A stock checkpoint's optimizer state is the
    one-process state dict `stock_optimizer`. `require_optimizer`: a checkpoint without
    optimizer state, or with one share of it only, is refused (resuming would restart the
    moments), never skipped."""
    if optimizer is None and not weights:
        return
    rank, world = rank_and_world()
    mine = owned_params(engine)
    owned_ids = None if mine is None else {id(p) for p in mine}
    updated = owned_params(engine, updated=True)  # whose moments this rank holds
    updated_ids = None if updated is None else {id(p) for p in updated}

    def owned(p: torch.Tensor) -> bool:
        return owned_ids is None or id(p) in owned_ids

    def updates(p: torch.Tensor) -> bool:
        return updated_ids is None or id(p) in updated_ids

    if manifest is not None:
        check_layout(manifest, model, world_size=world)
        if require_optimizer and manifest["optimizer"] is None:
            raise ValueError(f"{directory} holds no optimizer state (saved with "
                             "save_only_model); resuming from it would restart the moments")
        if manifest["world_size"] != world and rank == 0:
            logger.info("lazytrain: re-sharding a checkpoint written by %d ranks onto %d",
                        manifest["world_size"], world)
    # masters and moments homed on NVMe: in DRAM to load into, back to their files after
    with engine.masters_in_dram(optimizer) if engine is not None else contextlib.nullcontext():
        if weights:
            # (a split update: its node may hold layers as their compute copy alone)
            _load_owned_weights(model, directory, owned, split=mine is not None,
                                copies={} if mine is None else engine.pool.received_views())
        if optimizer is not None:
            _load_optimizer_state(optimizer, directory, manifest, model, updates, world=world,
                                  stock_optimizer=stock_optimizer,
                                  require_optimizer=require_optimizer)
    if weights and world > 1:
        dist.barrier()  # every owner's masters are in place before any rank reads them


def _load_owned_weights(model: nn.Module, directory: Path,
                        owned: Callable[[torch.Tensor], bool], *, split: bool,
                        copies: Mapping[nn.Parameter, torch.Tensor]) -> None:
    """The weights, but those in the node store that another rank owns (`split`: under a
    split update): their owner loads them. A layer this node holds as its compute copy
    alone (`copies`: each parameter's view in it) loads there, cast; its masters are
    another node's (placeholders here)."""
    from lazytrain_accel.distributed.node_store import is_placeholder, shared_params

    in_store = {id(p) for _, p in shared_params(model)} if split else set()
    load_weights(model, directory,
                 loads=lambda t: (id(t) not in in_store or owned(t)) and not is_placeholder(t),
                 also={id(p): view for p, view in copies.items() if owned(p)})


def _load_optimizer_state(optimizer: torch.optim.Optimizer, directory: Path,
                          manifest: Mapping[str, Any] | None, model: nn.Module,
                          owned: Callable[[torch.Tensor], bool], *, world: int,
                          stock_optimizer: str, require_optimizer: bool) -> None:
    """The optimizer state this rank owns: from the shares, else from `stock_optimizer`
    (absent: nothing, or refused with `require_optimizer`)."""
    if manifest is not None and manifest["optimizer"] is not None:
        load_optimizer(optimizer, directory, manifest, param_names(model), owned,
                       world_size=world)
        return
    path = directory / stock_optimizer
    if not path.is_file():
        if require_optimizer:
            raise FileNotFoundError(f"{directory} has neither {MANIFEST} nor "
                                    f"{stock_optimizer}: no optimizer state to resume from")
        return
    load_stock_optimizer(optimizer, path, owned)
    if require_optimizer:
        _refuse_one_share(optimizer, path, model, owned, world=world)


def _refuse_one_share(optimizer: torch.optim.Optimizer, path: Path, model: nn.Module,
                      owned: Callable[[torch.Tensor], bool], *, world: int) -> None:
    """Raise if `path` held no state for some of the parameters this rank owns (while it
    held some)."""
    trainable = [p for g in optimizer.param_groups for p in g["params"]
                 if owned(p) and p.requires_grad]
    lacking = [p for p in trainable if not optimizer.state.get(p)]
    if optimizer.state and lacking:
        names = param_names(model)
        raise ValueError(f"{path} holds no state for {len(lacking)} of the {len(trainable)} "
                         f"parameters this rank (of {world}) owns (first: "
                         f"{names.get(lacking[0], '?')}): it holds one share only (written "
                         "under the node store by a version without share checkpoints); "
                         "resuming would restart their moments")


def load_weights(model: nn.Module, directory: Path, *,
                 loads: Callable[[torch.Tensor], bool],
                 also: Mapping[int, torch.Tensor] | None = None) -> int:
    """Copy the tensors of `model.state_dict()` for which `loads(tensor)` holds from the
    weights in `directory` (one file or shards, `checkpoint_layout.weight_files`), in
    place (compute copies keyed on the parameter's version see the change; a weight saved
    in another dtype is cast), and into `also[id(tensor)]` where given. Returns how many
    were loaded; raises naming missing keys."""
    from safetensors import safe_open

    also = also or {}
    files = weight_files(directory)
    if files is None:
        raise FileNotFoundError(f"{directory} holds no safetensors weights ({WEIGHTS} or "
                                "its index): not a checkpoint written with "
                                "safe_serialization=True")
    by_object: dict[int, list[str]] = {}
    targets: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_object.setdefault(id(tensor), []).append(name)
        targets[id(tensor)] = tensor
    missing = [names[0] for names in by_object.values() if not any(n in files for n in names)]
    if missing:
        raise ValueError(f"{directory} lacks {len(missing)} of the model's tensors (first: "
                         f"{missing[:3]}); the checkpoint is for another model")
    loaded = 0
    with contextlib.ExitStack() as stack, torch.no_grad():
        opened: dict[Path, Any] = {}
        for key, names in by_object.items():
            target = targets[key]
            loaded_here = loads(target)
            if not loaded_here and key not in also:
                continue
            name = next(n for n in names if n in files)
            if files[name] not in opened:
                opened[files[name]] = stack.enter_context(
                    safe_open(str(files[name]), framework="pt"))
            saved = opened[files[name]].get_tensor(name)
            if saved.shape != target.shape:
                raise ValueError(f"{names[0]}: the checkpoint holds shape "
                                 f"{tuple(saved.shape)}, the model {tuple(target.shape)}")
            if loaded_here:
                target.copy_(saved)
            if key in also:
                also[key].copy_(saved)
            loaded += 1
    return loaded


def load_optimizer(optimizer: torch.optim.Optimizer, directory: Path,
                   manifest: Mapping[str, Any], names: Mapping[nn.Parameter, str],
                   owned: Callable[[nn.Parameter], bool], *, world_size: int) -> None:
    """Load into `optimizer` the checkpoint's hyperparameters and the state of the
    parameters `owned` by this rank, from whichever shares hold them."""
    record = manifest["optimizer"]
    saved_from = manifest["world_size"]
    if record["class"] != type(optimizer).__name__:
        raise ValueError(f"the checkpoint holds {record['class']} state (written by "
                         f"{saved_from} ranks), this run's optimizer (on {world_size}) is "
                         f"{type(optimizer).__name__}; resume with the same optimizer")
    saved_groups = record["param_groups"]
    ours = [[name_of(p, names) for p in g["params"]] for g in optimizer.param_groups]
    if [g["params"] for g in saved_groups] != ours:
        saved_sizes = [len(g["params"]) for g in saved_groups]
        raise ValueError(f"the optimizer's param groups differ from the checkpoint's "
                         f"({len(saved_groups)} groups of {saved_sizes} parameters saved, "
                         f"{len(ours)} of {[len(g) for g in ours]} now)")
    holder = {name: share["file"] for share in manifest["shares"] for name in share["params"]}
    index_of, wanted_by_file = {}, {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, p in enumerate(params):
        name = names[p]
        if owned(p) and name in holder:
            index_of[name] = index
            wanted_by_file.setdefault(holder[name], set()).add(name)
    state: dict[int, dict[str, Any]] = {}
    for file, wanted in wanted_by_file.items():
        path = directory / file
        if not path.is_file():
            raise ValueError(f"cannot re-shard the checkpoint written by {saved_from} ranks "
                             f"onto {world_size}: {path} (a share named by its manifest) is "
                             "missing; copy every share file of the checkpoint")
        for name, items in read_share(path, wanted).items():
            master = items.pop(MASTER_KEY, None)
            if master is not None:  # the weights were an export cast: the exact master
                with torch.no_grad():
                    params[index_of[name]].copy_(master)
            if items:
                state[index_of[name]] = items
    groups, start = [], 0
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        count = len(group["params"])
        hyper = {k: decode_value(v) for k, v in saved.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + count))})
        start += count
    # In parameter order, as `state_dict()` gives it: `optimizer.state` keeps that order.
    optimizer.load_state_dict({"state": dict(sorted(state.items())), "param_groups": groups})


def load_stock_optimizer(optimizer: torch.optim.Optimizer, path: Path,
                         owned: Callable[[nn.Parameter], bool]) -> None:
    """A stock checkpoint's `optimizer.bin` (one process's full state) as one share:
    load the state of the parameters `owned` by this rank."""
    saved = torch.load(path, map_location="cpu", weights_only=False)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in saved["param_groups"] for i in g["params"]]
    if len(saved_ids) != len(params):
        raise ValueError(f"{path} holds state for {len(saved_ids)} parameters, this run's "
                         f"optimizer has {len(params)}; the checkpoint is for another model")
    keep = {i for i, p in zip(saved_ids, params, strict=True) if owned(p)}
    optimizer.load_state_dict({**saved, "state": {i: s for i, s in saved["state"].items()
                                                  if i in keep}})
