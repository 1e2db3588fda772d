"""Share checkpoints: each weight once, the optimizer state per rank's share, a manifest.

Under the node store every parameter is a view of one shared segment and each rank holds
the optimizer state of its share only, so stock `save_state` would save rank 0's state
alone and de-duplicate every parameter as an alias. Instead: the weights (`layout.py`),
`optimizer_share_<r>.safetensors` per rank ("<param name>/<state key>" tensors) and
`lazytrain_shares.json` (`MANIFEST_FIELDS`), written last; one process or replicated
ranks write one share. The save is atomic (`atomic.py`, published by global rank 0): a
failure on any rank keeps the previous checkpoint and raises on every rank. `load_shares`
checks the layout hash and re-shards a checkpoint of N ranks onto any M.
Docs: docs/user_guide.md "7. Several GPUs" ("Checkpoints") and "8. Checkpoints".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lazytrain_accel.checkpoints.atomic import remove_directory
from lazytrain_accel.checkpoints.layout import (
    CHECKPOINT_DTYPES,
    DEFAULT_MAX_SHARD_BYTES,
    WEIGHTS,
    export_dtype,
    weight_files,
    write_safetensors,
    write_weight_files,
)

logger = logging.getLogger("lazytrain_accel")

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


def load_weights(model: nn.Module, directory: Path, *,
                 loads: Callable[[torch.Tensor], bool]) -> int:
    """Copy the tensors of `model.state_dict()` for which `loads(tensor)` holds from the
    weights in `directory` (one file or shards, `checkpoint_layout.weight_files`), in
    place (compute copies keyed on the parameter's version see the change; a weight saved
    in another dtype is cast). Returns how many were loaded; raises naming missing keys."""
    from safetensors import safe_open

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
            if not loads(target):
                continue
            name = next(n for n in names if n in files)
            if files[name] not in opened:
                opened[files[name]] = stack.enter_context(
                    safe_open(str(files[name]), framework="pt"))
            saved = opened[files[name]].get_tensor(name)
            if saved.shape != target.shape:
                raise ValueError(f"{names[0]}: the checkpoint holds shape "
                                 f"{tuple(saved.shape)}, the model {tuple(target.shape)}")
            target.copy_(saved)
            loaded += 1
    return loaded


# ---- the optimizer state per share --------------------------------------------------------
def _encode(value: Any) -> Any:
    """A param group's hyperparameter as JSON, exactly (floats by repr, tuples kept)."""
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).rsplit(".", 1)[-1]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"an optimizer hyperparameter of type {type(value).__name__} "
                     f"({value!r}) cannot be written to the checkpoint's manifest")


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def optimizer_record(optimizer: torch.optim.Optimizer, names: Mapping[nn.Parameter, str]
                     ) -> dict[str, Any]:
    """The manifest's `optimizer`: its class and its param groups (hyperparameters as
    they are now, parameters by name)."""
    groups = []
    for group in optimizer.param_groups:
        params = [_name_of(p, names) for p in group["params"]]
        groups.append({**{k: _encode(v) for k, v in group.items() if k != "params"},
                       "params": params})
    return {"class": type(optimizer).__name__, "param_groups": groups}


def _name_of(p: nn.Parameter, names: Mapping[nn.Parameter, str]) -> str:
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
        name = _name_of(p, names)
        written.append(name)
        if cast:
            tensors.append((f"{name}/{MASTER_KEY}", p, p))
        order[name] = list(state or {})
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor):
                tensors.append((f"{name}/{key}", value, p))
            else:
                scalars.setdefault(name, {})[key] = _encode(value)
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
                out.setdefault(name, {}).update({k: _decode(v) for k, v in items.items()})
    for name, items in out.items():
        keys = [MASTER_KEY] * (MASTER_KEY in items) + order.get(name, sorted(items))
        out[name] = {k: items[k] for k in keys if k in items} | items
    return out


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
    ours = [[_name_of(p, names) for p in g["params"]] for g in optimizer.param_groups]
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
        hyper = {k: _decode(v) for k, v in saved.items() if k != "params"}
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


def run_manifest(accelerator: Any, optimizer: torch.optim.Optimizer | None,
                 shares: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The manifest of a checkpoint of this run at its current step: the launch's world,
    local world and node count, the model's layout, `optimizer`'s record (None: no
    optimizer state saved) and every rank's `share_record`."""
    _, world = rank_and_world()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    model = accelerator.lazytrain.model
    return build_manifest(
        world_size=world, local_world_size=local, nodes=max(1, world // local),
        step=int(accelerator.step), layout=layout_hash(model),
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


# ---- coordination -----------------------------------------------------------------------
@contextlib.contextmanager
def hidden(accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None
           ) -> Iterator[None]:
    """Hide the streamed model and its optimizer from accelerate's stock save/load (which
    still handles the schedulers, samplers, RNG states, scaler and custom objects), and
    its automatic checkpoint naming (the directory is chosen: `target_directory`)."""
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models = [m for m in models if m is not model]
    accelerator._optimizers = [o for o in optimizers
                               if getattr(o, "optimizer", o) is not optimizer]
    try:
        with _no_automatic_naming(accelerator):  # the caller chose the directory
            yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


def describe_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# ---- the save and the load of a run -------------------------------------------------------
def owned_params(engine: Any) -> list[nn.Parameter] | None:
    """The parameters of the groups this rank owns in a split update (groups every rank
    owns included); None without one (this rank holds and updates everything)."""
    peers = engine.steps.peers if engine is not None else None
    if peers is None:
        return None
    return [p for g, ps in enumerate(engine.steps.update_groups) if peers.owns(g) for p in ps]


def target_directory(accelerator: Any, output_dir: str | None) -> Path:
    """Where `save_state(output_dir)` writes: `output_dir`, or with accelerate's
    automatic checkpoint naming `<project_dir>/checkpoints/checkpoint_<i>` (the oldest
    beyond `total_limit` go once it is published: `rotate`)."""
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state() needs an output_dir (or a ProjectConfiguration "
                             "with automatic_checkpoint_naming=True)")
        return Path(output_dir)
    final = Path(accelerator.project_dir) / "checkpoints" / (
        f"checkpoint_{accelerator.save_iteration}")
    if final.exists():
        raise ValueError(f"Checkpoint directory {final} ({accelerator.save_iteration}) "
                         "already exists; set `save_iteration` to the iteration to start "
                         "with")
    return final


def rotate(accelerator: Any, final: Path) -> None:
    """After `final` is published, with automatic naming: remove the oldest checkpoints
    beyond `total_limit` (the main process), as stock does before its save; never before
    the new one is complete."""
    config = accelerator.project_configuration
    if (not config.automatic_checkpoint_naming or config.total_limit is None
            or not accelerator.is_main_process):
        return
    folders = _numbered(final.parent)
    for folder in folders[:max(0, len(folders) - config.total_limit)]:
        remove_directory(folder)  # never half a checkpoint under its name


def latest_directory(accelerator: Any) -> Path:
    """What `load_state()` without a folder resumes from under automatic naming: the
    highest `<project_dir>/checkpoints/checkpoint_<i>`. Only a published checkpoint has
    that name; stock accelerate takes the first number in any entry's name, so it would
    take a killed save's `.checkpoint_<i+1>.tmp-<pid>` for the latest."""
    parent = Path(accelerator.project_dir) / "checkpoints"
    folders = _numbered(parent) if parent.is_dir() else []
    if not folders:
        raise FileNotFoundError(f"load_state() found no checkpoint_<i> folder in {parent} "
                                "to resume from: pass the folder to load, or save first")
    return folders[-1]


def _numbered(parent: Path) -> list[Path]:
    """The `checkpoint_<i>` folders of `parent`, by i."""
    return sorted((f for f in parent.iterdir() if f.name.startswith("checkpoint_")
                   and f.name.rsplit("_", 1)[-1].isdigit()),
                  key=lambda f: int(f.name.rsplit("_", 1)[-1]))


@contextlib.contextmanager
def _no_automatic_naming(accelerator: Any) -> Iterator[None]:
    config = accelerator.project_configuration
    automatic, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
    try:
        yield
    finally:
        config.automatic_checkpoint_naming = automatic


def save_shares(accelerator: Any, final: Path, write_stock: Callable[[Path], None], *,
                weights: bool = True, optimizer_state: bool = True,
                label: str = "save_state") -> None:
    """Write the checkpoint at `final` from every rank (`save_on_every_rank`); every rank
    calls it at the same point, after the step's update. Without a split update (one
    process, or replicated ranks) rank 0 writes the one share. `weights=False`:
    `write_stock` writes the weights (the Trainer's `save_model`);
    `optimizer_state=False`: no share files (the Trainer's `save_only_model`); `label`
    names the save in errors."""
    rank, world = rank_and_world()
    optimizer = accelerator.lazytrain.optimizer if optimizer_state else None
    mine, params = my_share(accelerator.lazytrain.engine, optimizer, rank=rank, world=world)

    def finish(tmp: Path, shares: list[Any]) -> None:
        manifest = run_manifest(accelerator, optimizer, shares)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))

    save_on_every_rank(final, lambda tmp: _write_rank_files(
        accelerator, tmp, rank=rank, mine=mine, params=params, write_stock=write_stock,
        weights=weights, optimizer=optimizer), finish=finish, label=label)


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def my_share(engine: Any, optimizer: torch.optim.Optimizer | None, *, rank: int,
              world: int) -> tuple[list[int], list[nn.Parameter]]:
    """The groups whose share this rank writes, and their parameters: under a split
    update the groups it owns (those every rank owns: rank 0); without one, rank 0 every
    parameter of the optimizer (the same on every rank), the others none."""
    import torch.distributed as dist

    groups = engine.steps.update_groups if engine is not None else []
    peers = engine.steps.peers if engine is not None else None
    if peers is None:
        if rank != 0 or optimizer is None:
            return [], []
        return (list(range(len(groups))),
                [p for g in optimizer.param_groups for p in g["params"]])
    owned = [g for g in range(len(groups)) if peers.owns(g)]
    everyone: list[list[int] | None] = [None] * world
    dist.all_gather_object(everyone, owned)
    shared_by_all = set.intersection(*(set(o) for o in everyone))
    mine = [g for g in owned if g not in shared_by_all or rank == 0]  # written once
    return mine, [p for g in mine for p in groups[g]]


def save_on_every_rank(final: Path, write: Callable[[Path], Any], *,
                       finish: Callable[[Path, list[Any]], None] | None = None,
                       label: str) -> None:
    """A checkpoint folder every rank writes into, published whole or not at all: rank 0
    opens `atomic_directory(final)` and names its temporary directory to all, every rank
    runs `write(tmp)` (its result: this rank's report), rank 0 runs `finish(tmp,
    reports)` and renames the directory into place once every rank has written. Any
    rank's failure is raised on every rank, `final` (a previous checkpoint) untouched.
    Every rank calls it at the same point; `label` names the save in errors."""
    import torch.distributed as dist

    from lazytrain_accel.checkpoints.atomic import atomic_directory

    if not (dist.is_available() and dist.is_initialized()):  # one process
        with atomic_directory(final) as tmp:
            report = write(tmp)
            if finish is not None:
                finish(tmp, [report])
        return
    tmp, stack = open_on_every_rank(final, label=label)
    try:
        report: tuple[str, Any] = ("ok", write(tmp))
    except Exception as err:  # reported to rank 0, raised on every rank
        report = ("error", describe_error(err))
    reports = gather_reports(report, stack, final=final, label=label)
    outcome: list[str | None] = [None]
    if stack is not None:
        try:
            if finish is not None:
                finish(tmp, reports)
            stack.close()  # fsync, rename into place: the checkpoint exists from here
        except BaseException as err:  # the temporary directory goes
            abandon(stack, err)
            outcome[0] = describe_error(err)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RuntimeError(f"{label}({final}) failed, the previous checkpoint (if any) "
                           f"is kept: {outcome[0]}")


def open_on_every_rank(final: Path, *, label: str
                       ) -> tuple[Path, contextlib.ExitStack | None]:
    """Rank 0 opens `atomic_directory(final)` and names its temporary directory to every
    rank (all call it at the same point); returns it, and on rank 0 the stack whose
    `close()` publishes it (None on the others). A failure to open is raised on every
    rank."""
    import torch.distributed as dist

    from lazytrain_accel.checkpoints.atomic import atomic_directory

    rank, _ = rank_and_world()
    stack = contextlib.ExitStack()
    if not (dist.is_available() and dist.is_initialized()):  # one process
        return stack.enter_context(atomic_directory(final)), stack
    opened: list[str | None] = [None, None]
    if rank == 0:
        try:
            opened[0] = str(stack.enter_context(atomic_directory(final)))
        except Exception as err:  # every rank must hear of it
            opened[1] = describe_error(err)
    dist.broadcast_object_list(opened, src=0)
    if opened[1] is not None:
        raise RuntimeError(f"{label}({final}): rank 0 could not open the checkpoint's "
                           f"temporary directory: {opened[1]}")
    return Path(opened[0]), stack if rank == 0 else None


def gather_reports(report: tuple[str, Any], stack: contextlib.ExitStack | None, *,
                   final: Path, label: str) -> list[Any]:
    """Every rank's `("ok", value)` or `("error", message)`, on every rank; the values
    when all are "ok". Otherwise rank 0 removes the temporary directory (`stack`) and
    every rank raises the failures, `final` untouched."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        reports: list[tuple[str, Any] | None] = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(reports, report)
        except BaseException as err:  # a rank died mid-save: no temporary directory left
            if stack is not None:
                abandon(stack, err)
            raise
    else:
        reports = [report]
    failed = {r: msg for r, (kind, msg) in enumerate(reports) if kind == "error"}
    if failed:
        err = RuntimeError("; ".join(f"rank {r}: {m}" for r, m in failed.items()))
        if stack is not None:
            abandon(stack, err)
        raise RuntimeError(f"{label}({final}) failed, the previous checkpoint (if any) "
                           f"is kept: {err}")
    return [value for _, value in reports]


def _write_rank_files(accelerator: Any, tmp: Path, *, rank: int, mine: Sequence[int],
                      params: Sequence[nn.Parameter], write_stock: Callable[[Path], None],
                      weights: bool, optimizer: torch.optim.Optimizer | None
                      ) -> dict[str, Any]:
    """This rank's files (its share; rank 0 the weights too, in the layout and dtype the
    plugin names) and the manifest's entry for the share."""
    model = accelerator.lazytrain.model
    plugin = accelerator.lazytrain_plugin
    dtype = CHECKPOINT_DTYPES[plugin.checkpoint_dtype] if weights else None
    written: list[str] = []
    if optimizer is not None and params:
        written = write_share(tmp / share_file(rank), optimizer, params, param_names(model),
                              weights_dtype=dtype)
    if rank == 0 and weights:
        write_weights(tmp, model, max_shard_bytes=plugin.checkpoint_max_shard_bytes,
                      dtype=dtype)
    write_stock(tmp)
    return share_record(rank=rank, mine=mine, optimizer=optimizer, params=params,
                        written=written)


def abandon(stack: contextlib.ExitStack, err: BaseException) -> None:
    """Close `atomic_directory` with `err`: its temporary directory is removed."""
    with contextlib.suppress(BaseException):
        stack.__exit__(type(err), err, err.__traceback__)


def load_shares(accelerator: Any, directory: Path, manifest: Mapping[str, Any] | None
                ) -> None:
    """Load the masters and the optimizer state this rank owns from a share checkpoint
    (`manifest`), or from a stock one (None: `model.safetensors`, `optimizer.bin`)."""
    import torch.distributed as dist

    from lazytrain_accel.distributed.node_store import shared_params

    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    model, optimizer = accelerator.lazytrain.model, accelerator.lazytrain.optimizer
    mine = owned_params(accelerator.lazytrain.engine)
    if manifest is not None:
        check_layout(manifest, model, world_size=world)
        if manifest["world_size"] != world and accelerator.is_main_process:
            logger.info("lazytrain: re-sharding a checkpoint written by %d ranks onto %d",
                        manifest["world_size"], world)
    owned_ids = None if mine is None else {id(p) for p in mine}
    in_store = {id(p) for _, p in shared_params(model)} if mine is not None else set()

    def owned(p: torch.Tensor) -> bool:
        return owned_ids is None or id(p) in owned_ids

    def loads(t: torch.Tensor) -> bool:  # the store's other params: their owner loads them
        return id(t) not in in_store or owned(t)

    load_weights(model, directory, loads=loads)
    if optimizer is not None:
        if manifest is not None and manifest["optimizer"] is not None:
            load_optimizer(optimizer, directory, manifest, param_names(model), owned,
                           world_size=world)
        elif (directory / STOCK_OPTIMIZER).is_file():
            load_stock_optimizer(optimizer, directory / STOCK_OPTIMIZER, owned)
    if distributed and world > 1:
        dist.barrier()  # every owner's masters are in place before any rank reads them


def load_optimizer_shares(accelerator: Any, directory: Path, manifest: Mapping[str, Any] | None,
                          stock_file: str) -> None:
    """The optimizer state this rank owns (all of it without a split update) from a
    share checkpoint (`manifest`) or, None, from the one-process state dict `stock_file`
    (the Trainer's `optimizer.pt`); the weights are loaded elsewhere (the Trainer loads
    them before `prepare`). What cannot load is refused, never skipped."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    model, optimizer = accelerator.lazytrain.model, accelerator.lazytrain.optimizer
    if optimizer is None:
        return
    mine = owned_params(accelerator.lazytrain.engine)
    owned_ids = None if mine is None else {id(p) for p in mine}

    def owned(p: torch.Tensor) -> bool:
        return owned_ids is None or id(p) in owned_ids

    if manifest is not None:
        check_layout(manifest, model, world_size=world)
        if manifest["optimizer"] is None:
            raise ValueError(f"{directory} holds no optimizer state (saved with "
                             "save_only_model); resuming from it would restart the moments")
        if manifest["world_size"] != world and (not distributed or dist.get_rank() == 0):
            logger.info("lazytrain: re-sharding a checkpoint written by %d ranks onto %d",
                        manifest["world_size"], world)
        load_optimizer(optimizer, directory, manifest, param_names(model), owned,
                       world_size=world)
        return
    path = directory / stock_file
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has neither {MANIFEST} nor {stock_file}: no "
                                "optimizer state to resume from")
    load_stock_optimizer(optimizer, path, owned)
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
