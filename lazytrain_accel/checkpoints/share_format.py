"""The share checkpoint's format: its files, their names and the manifest.

Under the node store every parameter is a view of one shared segment and each rank holds
the optimizer state of its share only, so a checkpoint holds the weights once
(`layout.py`), `optimizer_share_<r>.safetensors` per rank ("<param name>/<state key>"
tensors) and `lazytrain_shares.json` (`MANIFEST_FIELDS`), written last. Parameters are
named by `param_names` (a tied one by its first name) and checked by `layout_hash`.
Who writes what and how it is published: `publication.py`; the load: `resume.py`.
Docs: docs/user_guide.md "7. Several GPUs" ("Checkpoints") and "8. Checkpoints".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lazytrain_accel.checkpoints.layout import (
    DEFAULT_MAX_SHARD_BYTES,
    WEIGHTS,
    export_dtype,
    write_safetensors,
    write_weight_files,
)

MANIFEST = "lazytrain_shares.json"
STOCK_OPTIMIZER = "optimizer.bin"
FORMAT = "lazytrain-shares"
VERSION = 1
#: The manifest's top-level fields.
MANIFEST_FIELDS = ("format", "version", "world_size", "local_world_size", "nodes", "step",
                   "optimizer_steps", "layout_hash", "weights", "optimizer", "shares")


#: A share file's key for a parameter's fp32 master ("<name>/lazytrain_master"), written
#: when the weights files hold it in an export dtype (`write_share`).
MASTER_KEY = "lazytrain_master"


def share_file(rank: int) -> str:
    return f"optimizer_share_{rank}.safetensors"


# ---- names and layout --------------------------------------------------------------------
def param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's name (a tied parameter: its first name)."""
    return {p: n for n, p in reversed(list(model.named_parameters()))}


def layout_hash(model: nn.Module) -> str:
    """A digest of the parameters' names, shapes and trainability: two runs may exchange
    checkpoints exactly when it is equal (world sizes aside)."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.requires_grad};".encode())
    return digest.hexdigest()[:16]


def unique_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`model.state_dict()` with each tensor once: a tied parameter under its first name
    (as `save_pretrained` drops `lm_head.weight` when it is the embedding). Aliases are
    found by object, not by storage: under the node store all parameters share one."""
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor))
    return out


# ---- the weights ------------------------------------------------------------------------
def write_weights(directory: Path, model: nn.Module, *,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                  dtype: torch.dtype | None = None) -> list[str]:
    """The model's weights (each tensor once, `checkpoint_layout`: one file or shards and
    their index, in `dtype` or as the model holds them) and its `config.json`, so
    `from_pretrained(directory)` loads it. Returns the weight files written."""
    files = write_weight_files(directory, unique_state(model),
                               max_shard_bytes=max_shard_bytes, dtype=dtype)
    write_config(directory, model)
    return files


def write_config(directory: Path, model: nn.Module) -> None:
    """The model's `config.json`, if it has one (a transformers model)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(str(directory / "config.json"))


def saved_elements(directory: Path) -> int | None:
    """How many elements the safetensors weights in `directory` hold (`model.safetensors`
    or the shards an index names), read from the headers only; None without either."""
    directory = Path(directory)
    index = directory / f"{WEIGHTS}.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        return None
    total = 0
    for name in files:
        with open(directory / name, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, entry in header.items():
            if key != "__metadata__":
                numel = 1
                for dim in entry["shape"]:
                    numel *= dim
                total += numel
    return total


def check_weights_complete(directory: Path, model: nn.Module) -> None:
    """Raise if the weights written to `directory` hold fewer elements than the model's
    state (each tensor once): a writer that de-duplicated by storage, as accelerate's does
    for the node store's one shared buffer, would have dropped weights."""
    saved = saved_elements(directory)
    if saved is None:
        return
    expected = sum(t.numel() for _, t in unique_state(model))
    if saved < expected:
        raise ValueError(f"the weights written to {directory} hold {saved} elements, the "
                         f"model {expected}: weights were dropped (storage de-duplication "
                         "under the node store?); refusing to publish the checkpoint")


# ---- the optimizer state per share --------------------------------------------------------
def encode_value(value: Any) -> Any:
    """A param group's hyperparameter as JSON, exactly (floats by repr, tuples kept)."""
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).rsplit(".", 1)[-1]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"an optimizer hyperparameter of type {type(value).__name__} "
                     f"({value!r}) cannot be written to the checkpoint's manifest")


def decode_value(value: Any) -> Any:
    """`encode_value`'s inverse."""
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(decode_value(v) for v in value["__tuple__"])
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    return value


def optimizer_record(optimizer: torch.optim.Optimizer, names: Mapping[nn.Parameter, str]
                     ) -> dict[str, Any]:
    """The manifest's `optimizer`: its class and its param groups (hyperparameters as
    they are now, parameters by name)."""
    groups = []
    for group in optimizer.param_groups:
        params = [name_of(p, names) for p in group["params"]]
        groups.append({**{k: encode_value(v) for k, v in group.items() if k != "params"},
                       "params": params})
    return {"class": type(optimizer).__name__, "param_groups": groups}


def name_of(p: nn.Parameter, names: Mapping[nn.Parameter, str]) -> str:
    """`p`'s name in `names`; refused when `p` is not a parameter of the model."""
    try:
        return names[p]
    except KeyError:
        raise ValueError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is "
                         "not a parameter of the model; a share checkpoint names state by "
                         "parameter") from None


def write_share(path: Path, optimizer: torch.optim.Optimizer | None,
                params: Iterable[nn.Parameter], names: Mapping[nn.Parameter, str], *,
                weights_dtype: torch.dtype | None = None) -> list[str]:
    """Write the state of `params` and their masters (`share_tensors`) to `path`; return
    the names written."""
    tensors, metadata, written = share_tensors(optimizer, params, names,
                                               weights_dtype=weights_dtype)
    write_safetensors(path, [(key, t) for key, t, _ in tensors], metadata=metadata)
    return written


def share_tensors(optimizer: torch.optim.Optimizer | None, params: Iterable[nn.Parameter],
                  names: Mapping[nn.Parameter, str], *,
                  weights_dtype: torch.dtype | None = None
                  ) -> tuple[list[tuple[str, torch.Tensor, nn.Parameter]], dict[str, str],
                             list[str]]:
    """A share's content: ("<name>/<state key>", tensor, its parameter) for the state of
    `params` (those that have any), and the fp32 master (`MASTER_KEY`) of each parameter
    the weights hold in another dtype (`weights_dtype`, an export cast): a resume
    continues from the masters, not from their rounding. Also the file's metadata (the
    non-tensor state values by name; each state's key order, which a safetensors file
    does not keep and `state_dict()` round trips do), and the names written."""
    tensors: list[tuple[str, torch.Tensor, nn.Parameter]] = []
    scalars: dict[str, dict[str, Any]] = {}
    order: dict[str, list[str]] = {}
    written = []
    for p in params:
        state = optimizer.state.get(p) if optimizer is not None else None
        cast = export_dtype(p, weights_dtype) != p.dtype
        if not state and not cast:
            continue
        name = name_of(p, names)
        written.append(name)
        if cast:
            tensors.append((f"{name}/{MASTER_KEY}", p, p))
        order[name] = list(state or {})
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor):
                tensors.append((f"{name}/{key}", value, p))
            else:
                scalars.setdefault(name, {})[key] = encode_value(value)
    metadata = {"lazytrain_scalars": json.dumps(scalars), "lazytrain_order": json.dumps(order)}
    return tensors, metadata, written


def read_share(path: Path, wanted: set[str]) -> dict[str, dict[str, Any]]:
    """The state of the parameters named in `wanted` that the share file holds, each in
    its saved key order (a master, `MASTER_KEY`, first)."""
    from safetensors import safe_open

    out: dict[str, dict[str, Any]] = {}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        scalars = json.loads(metadata.get("lazytrain_scalars", "{}"))
        order = json.loads(metadata.get("lazytrain_order", "{}"))
        for key in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
            name, _, item = key.rpartition("/")
            if name in wanted:
                out.setdefault(name, {})[item] = f.get_tensor(key)
        for name, items in scalars.items():
            if name in wanted:
                out.setdefault(name, {}).update({k: decode_value(v) for k, v in items.items()})
    for name, items in out.items():
        keys = [MASTER_KEY] * (MASTER_KEY in items) + order.get(name, sorted(items))
        out[name] = {k: items[k] for k in keys if k in items} | items
    return out


# ---- the manifest -----------------------------------------------------------------------
def build_manifest(*, world_size: int, local_world_size: int, nodes: int, step: int,
                   layout: str, optimizer: Mapping[str, Any] | None,
                   shares: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    steps = [s.get("optimizer_steps", 0) for s in shares]
    return {"format": FORMAT, "version": VERSION, "world_size": world_size,
            "local_world_size": local_world_size, "nodes": nodes, "step": step,
            "optimizer_steps": max(steps, default=0), "layout_hash": layout,
            "weights": WEIGHTS, "optimizer": optimizer,
            "shares": [dict(s) for s in shares]}


def run_manifest(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 shares: Sequence[Mapping[str, Any]], *, step: int, world_size: int,
                 local_world_size: int) -> dict[str, Any]:
    """The manifest of a checkpoint of `model` at `step`: the launch's world, local world
    and node count, the model's layout, `optimizer`'s record (None: no optimizer state
    saved) and every rank's `share_record`."""
    return build_manifest(
        world_size=world_size, local_world_size=local_world_size,
        nodes=max(1, world_size // local_world_size), step=step, layout=layout_hash(model),
        optimizer=None if optimizer is None else optimizer_record(
            optimizer, param_names(model)),
        shares=shares)


def share_record(*, rank: int, mine: Sequence[int], optimizer: torch.optim.Optimizer | None,
                 params: Sequence[nn.Parameter], written: Sequence[str]) -> dict[str, Any]:
    """The manifest's entry for `rank`'s share: the groups it writes (`mine`) and, when it
    writes optimizer state (`params`), its file and the parameter names in it."""
    has_file = optimizer is not None and bool(params)
    return {"rank": rank, "groups": list(mine), "file": share_file(rank) if has_file else None,
            "params": list(written) if has_file else [],
            "optimizer_steps": max_step(optimizer, params) if has_file else 0}


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: not a version-{VERSION} {FORMAT} manifest; written by "
                         "another LazyTrain version")
    return manifest


def check_layout(manifest: Mapping[str, Any], model: nn.Module, *, world_size: int) -> None:
    if manifest["layout_hash"] != layout_hash(model):
        raise ValueError(f"the checkpoint (written by {manifest['world_size']} ranks) is for "
                         f"another model than this run's (on {world_size}): parameter "
                         "names, shapes or trainability differ (layout hash "
                         f"{manifest['layout_hash']} vs {layout_hash(model)})")


def max_step(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> int:
    steps = [float(s["step"]) for p in params if (s := optimizer.state.get(p))
             and "step" in s]
    return int(max(steps, default=0))


# ---- one rank's files ---------------------------------------------------------------------
def write_rank_files(tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                     rank: int, mine: Sequence[int], params: Sequence[nn.Parameter],
                     weights: bool, dtype: torch.dtype | None, max_shard_bytes: int
                     ) -> dict[str, Any]:
    """This rank's files of a blocking save into `tmp`: its share of `optimizer` (`params`,
    of the groups `mine`) and, on rank 0 with `weights`, the weights in `dtype`; returns
    the manifest's entry for the share."""
    written: list[str] = []
    if optimizer is not None and params:
        written = write_share(tmp / share_file(rank), optimizer, params, param_names(model),
                              weights_dtype=dtype)
    if rank == 0 and weights:
        write_weights(tmp, model, max_shard_bytes=max_shard_bytes, dtype=dtype)
    return share_record(rank=rank, mine=mine, optimizer=optimizer, params=params,
                        written=written)
