"""`LazyTrainConfig` (alias `LazyTrainPlugin`): every user-facing setting, in one place.

Each field defaults to ``None``; ``__post_init__`` fills it from ``LAZYTRAIN_<FIELD>`` in
the environment, then from the built-in default, then coerces and validates it. So an
explicit argument beats the environment, which beats the default. Environment variables
are read in this module only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# One way only: config checks a hardware name against the presets; profiling never reads
# config (its callers pass the directories it needs), so neither imports the other back.
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.storage import drives
from lazytrain_accel.suggest import did_you_mean

ENV_PREFIX = "LAZYTRAIN_"

#: Strategy names a plan may be given as, besides "auto" and a JSON path.
STRATEGIES: tuple[str, ...] = (
    "lazytrain",
    "megatrain",
    "checkpoint_all",
    "offload_all",
    "lazytrain_gpu_only",
)


class OptimizerChoice(str, enum.Enum):
    """What `prepare` does with the user's optimizer."""

    HYBRID8BIT = "hybrid8bit"  # replace it by the hybrid 8-bit CPU operator
    KEEP = "keep"  # keep the user's optimizer class, stepping on the host masters


def default_cache_dir() -> str:
    """`LAZYTRAIN_CACHE_DIR`, else `$XDG_CACHE_HOME/lazytrain_accel` (~/.cache by default).

    For code that needs the cache without a full config (e.g. `load_hardware("auto")`, which
    reads no environment itself).
    """
    explicit = os.environ.get(ENV_PREFIX + "CACHE_DIR", "").strip()
    if explicit:
        return explicit
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(root) / "lazytrain_accel")


def default_nvme_dir() -> str:
    """`LAZYTRAIN_NVME_DIR`, else `<tmp>/lazytrain_nvme`."""
    import tempfile

    explicit = os.environ.get(ENV_PREFIX + "NVME_DIR", "").strip()
    return explicit or str(Path(tempfile.gettempdir()) / "lazytrain_nvme")


#: `node_store_dir`'s value for an anonymous segment (`memfd_create`), not a directory.
ANONYMOUS_SEGMENT = "memfd"

_DEFAULTS: dict[str, Any] = {
    "plan": "auto",
    "hardware": "auto",
    "optimizer": OptimizerChoice.HYBRID8BIT,
    "nvme_dir": default_nvme_dir,
    "gpu_memory_limit_gb": 0.0,
    "cpu_memory_limit_gb": 0.0,
    "nvme_limit_gb": 0.0,
    "max_recompute_block": 8,
    "solver_time_limit_s": 60.0,
    "cache_dir": default_cache_dir,
    "max_nonfinite_skips": 3,
    "loss_chunk_tokens": "auto",
    "batch_size": 0,
    "seq_len": 0,
    "emulate_async": False,
    "emulate_seed": 0,
    "emulate_links": "off",
    "threads": 0,
    "overlap_step": "auto",
    "frozen_weights": "keep",
    "resident_update": "auto",
    "node_store": "auto",
    "node_layout": "replicated",
    "pin_chunk_max_gib": 256.0,
    "bind_cores": "auto",
    "node_store_dir": ANONYMOUS_SEGMENT,
    "replan": "auto",
    "replan_min_gain": 0.05,
    "checkpoint_max_shard_bytes": 50 * 10**9,  # save_pretrained's max_shard_size="50GB"
    "checkpoint_dtype": "auto",
    "checkpoint_mode": "async",
    "checkpoint_write_bytes_per_s": 0.0,
}

#: `frozen_weights` values: keep frozen weights as loaded, or quantize them at `prepare`.
FROZEN_WEIGHTS: tuple[str, ...] = ("keep", "nf4", "fp4", "int8")

#: Link throttling modes of the emulated async device (or the path of a hardware JSON
#: whose rates the links run at).
EMULATE_LINKS: tuple[str, ...] = ("profile", "off")

#: `replan` values: re-plan on measured rates at a step boundary, or keep the first plan.
REPLAN_CHOICES: tuple[str, ...] = ("auto", "off")

#: `resident_update` values: where the embeddings', final norm's and head's update runs
#: (planning/solve.py `make_plan`): the planner's choice, the host, or the GPU.
RESIDENT_UPDATE_CHOICES: tuple[str, ...] = ("auto", "host", "device")

#: `node_store` values: share one host copy per node and split the update across the
#: local ranks where it can be used, or keep a full copy per rank (all-reduce).
NODE_STORE_CHOICES: tuple[str, ...] = ("auto", "off")

#: `node_layout` values (`planning/node.py:NODE_LAYOUTS`): over several nodes, each node
#: holds the whole host state, or 1/K of the masters, moments and gradients.
NODE_LAYOUT_CHOICES: tuple[str, ...] = ("replicated", "split")

#: `bind_cores` values: bind each local rank's threads to cores of its own, or leave them.
BIND_CORES_CHOICES: tuple[str, ...] = ("auto", "off")

#: `checkpoint_dtype` values (checkpoints/layout.py `CHECKPOINT_DTYPES`): the
#: weights files in the dtype the model holds each tensor in, or in a named one (export).
CHECKPOINT_DTYPE_CHOICES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")

#: `checkpoint_mode` values: `save_state` starts the save and returns ("async"), or
#: returns once the checkpoint is on the disk ("sync").
CHECKPOINT_MODES: tuple[str, ...] = ("async", "sync")

#: Fields that take one of a fixed set of strings.
_CHOICES: dict[str, tuple[str, ...]] = {"emulate_links": EMULATE_LINKS,
                                        "frozen_weights": FROZEN_WEIGHTS,
                                        "resident_update": RESIDENT_UPDATE_CHOICES,
                                        "node_store": NODE_STORE_CHOICES,
                                        "node_layout": NODE_LAYOUT_CHOICES,
                                        "bind_cores": BIND_CORES_CHOICES,
                                        "replan": REPLAN_CHOICES,
                                        "checkpoint_dtype": CHECKPOINT_DTYPE_CHOICES,
                                        "checkpoint_mode": CHECKPOINT_MODES}
#: Choice fields that also take the path of a JSON file.
_JSON_CHOICES: tuple[str, ...] = ("emulate_links",)


def _check_choice(name: str, value: str) -> None:
    if name in _JSON_CHOICES and _is_json_path(value):
        if not Path(value).is_file():
            raise ValueError(f"{name}={value!r}: no such hardware JSON file; write one with "
                             "`lazytrain profile --hardware auto --save-hardware PATH`")
        return
    if value not in _CHOICES[name]:
        also = " or the path of a hardware JSON file" if name in _JSON_CHOICES else ""
        raise ValueError(f"{name}={value!r} is not valid: use one of "
                         f"{list(_CHOICES[name])}{also}")


@dataclass(kw_only=True)
class LazyTrainConfig:
    """Settings of a LazyTrain run; also the Accelerate plugin (`LazyTrainPlugin`).

    Args:
        plan: "auto" (profile + solve the MIP), a strategy name (one of `STRATEGIES`) or
            the path of a plan JSON written by `lazytrain plan --output`.
        hardware: "auto" (measure this machine), a preset name (`lazytrain profile
            --list-hardware`) or the path of a hardware profile JSON.
        optimizer: "hybrid8bit" replaces the user's optimizer by the hybrid 8-bit CPU
            operator; "keep" keeps the user's optimizer class on the host masters.
        nvme_dir: directory for the activations and host state the plan homes on NVMe;
            several drives: one directory on each, as a list or joined by "," (the
            files spread over them, `storage/drives.py`).
        gpu_memory_limit_gb / cpu_memory_limit_gb / nvme_limit_gb: budgets for the
            planner; 0 means "what the hardware profile says".
        max_recompute_block: K, the longest recompute block the planner may choose.
        solver_time_limit_s: wall-clock limit of the MIP solve; the incumbent is used
            on timeout.
        cache_dir: where profiles and plans are cached by fingerprint.
        max_nonfinite_skips: consecutive non-finite steps tolerated before training
            stops with an error.
        loss_chunk_tokens: "auto" (default) lets the planner turn the fused chunked loss
            on (and pick the chunk) where the full logits would bind a budget or slow the
            plan (`Plan.loss_chunk_tokens` says what it chose); 0 keeps the model's own
            loss (full tokens x vocab logits); > 0 computes the training loss with the
            fused chunked cross-entropy, whose logits exist for that many tokens at a time.
            With the fused loss on, training outputs carry `logits=None`; evaluation
            (`model.eval()`) still returns logits.
        batch_size / seq_len: the micro-batch shape to plan for; 0 (the default) sizes
            the plan from the data (the run's sequence bound or its first batch) and
            re-plans once upward, cached, if a longer batch arrives.
        emulate_async: on a CPU, run the engine on the emulated async device (worker-thread
            streams, poisoned destinations; docs/engine.md "Emulated async device").
        emulate_seed: seed of the emulation's random delays (a failure names it).
        emulate_links: "profile" throttles the emulated links to the hardware profile's
            H2D, D2H and NVMe rates; "off" leaves them unthrottled; the path of a hardware
            JSON throttles them to that profile's rates while the plan uses `hardware` (a
            machine that differs from its profile, on a CPU).
        threads: torch intra-op threads (also the update kernel's); 0 sizes them by the
            rule of `lazytrain_accel/threads.py` at `prepare`, N > 0 uses N.
        overlap_step: with optimizer="hybrid8bit", `optimizer.step()` starts the update
            layer by layer on a CPU thread and returns; the next forward of layer j waits
            only for layer j (docs/engine.md "Step overlap"). False runs it serially.
            "auto" (default) overlaps unless the device is this CPU (not emulated): there
            the compute takes every core and an update beside it only oversubscribes them.
        frozen_weights: "keep" streams frozen weights as loaded (a bitsandbytes base stays
            packed); "nf4" / "fp4" / "int8" quantize the frozen linears of the decoder
            layers with bitsandbytes at `prepare` (QLoRA from a bf16 base).
        resident_update: where the embeddings', final norm's and head's masters, 8-bit
            state and update live: "auto" (default) lets the planner put them on the GPU
            where the plan leaves room and the step gets faster (`Plan.resident_update`
            says what it chose); "host" keeps them with the layers'; "device" puts them on
            the GPU, charged to its budget. Needs optimizer="hybrid8bit".
        node_store: with several processes on one node, "auto" (default) maps one host
            copy of the parameters per node from shared memory and splits the update
            across the local ranks (docs/user_guide.md "Several GPUs"); "off" keeps a full
            copy and the whole update on every rank, gradients all-reduced.
        node_layout: over several nodes (each with its node store), "replicated"
            (default) keeps the whole host state on every node, the gradients all-reduced
            and every node updating alike; "split" updates each group on one node only
            (its masters' moments and reduced gradients there alone), the gradients
            reduced to that node and the new weights broadcast from it
            (docs/user_guide.md "Several nodes").
        pin_chunk_max_gib: the node store is page-locked (`cudaHostRegister`) in chunks of
            at most this many GiB (default 256: one registration of >= 512 GiB fails on
            real systems); where it cannot be, training goes on from pageable memory,
            planned with the pageable copy rates (`engine/device/pinning.py`).
        bind_cores: with several processes on one node, "auto" (default) binds each local
            rank's threads to a disjoint set of the usable cores, inside one socket where
            it can (`lazytrain_accel/cores.py`), unless `threads` is set or the launcher
            pinned the ranks itself; "off" leaves every rank on every core.
        node_store_dir: where the node store's segment lives: "memfd" (default) an
            anonymous one, bounded by host memory and not by /dev/shm's size; a directory
            (e.g. a hugetlbfs mount) a file there, unlinked once created, bounded by that
            filesystem's free bytes (when they cannot hold it, each rank keeps its own copy
            if host memory allows, else `prepare` refuses).
        replan: "auto" (default) fits the profile's rates to what the engine measures
            after a warm-up and, when the plan for those rates is predicted
            `replan_min_gain` faster than the running one, switches to it at a step
            boundary (docs/planner.md "Re-planning"); "off" keeps the first plan.
        replan_min_gain: the predicted gain (a fraction of the step, default 0.05) a new
            plan must bring for `replan="auto"` to switch to it.
        checkpoint_max_shard_bytes: the largest weights file a checkpoint writes; more
            weights go into several `model-0000i-of-0000n.safetensors` and
            `model.safetensors.index.json` (default 50 * 10**9, `save_pretrained`'s).
        checkpoint_dtype: the dtype of a checkpoint's weights files: "auto" (default) as
            the model holds them (fp32 masters), or "bfloat16" / "float16" / "float32"
            for export; a cast keeps the fp32 masters in the optimizer share files, so a
            resume stays exact (docs/user_guide.md "Checkpoints").
        checkpoint_mode: "async" (default): `save_state` and the Trainer's checkpoint
            write the small files, start a writer thread for the masters and optimizer
            state and return; the next update of each layer waits until the save has
            written it. "sync": they return once the checkpoint is published.
        checkpoint_write_bytes_per_s: cap the asynchronous writer's rate (0, the default:
            as fast as the disk takes it), leaving the disk to other work.
    """

    plan: str | None = None
    hardware: str | None = None
    optimizer: OptimizerChoice | str | None = None
    nvme_dir: str | Sequence[str] | None = None
    gpu_memory_limit_gb: float | None = None
    cpu_memory_limit_gb: float | None = None
    nvme_limit_gb: float | None = None
    max_recompute_block: int | None = None
    solver_time_limit_s: float | None = None
    cache_dir: str | None = None
    max_nonfinite_skips: int | None = None
    loss_chunk_tokens: int | str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    emulate_async: bool | None = None
    emulate_seed: int | None = None
    emulate_links: str | None = None
    threads: int | None = None
    overlap_step: bool | str | None = None
    frozen_weights: str | None = None
    resident_update: str | None = None
    node_store: str | None = None
    node_layout: str | None = None
    pin_chunk_max_gib: float | None = None
    bind_cores: str | None = None
    node_store_dir: str | None = None
    replan: str | None = None
    replan_min_gain: float | None = None
    checkpoint_max_shard_bytes: int | None = None
    checkpoint_dtype: str | None = None
    checkpoint_mode: str | None = None
    checkpoint_write_bytes_per_s: float | None = None
    _explicit: frozenset[str] = field(default=frozenset(), init=False, repr=False)
    _from_env: frozenset[str] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        explicit, from_env, origins = set(), set(), {}
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                continue
            value, origin = getattr(self, f.name), "argument"
            if value is not None:
                explicit.add(f.name)
            else:
                # An empty variable counts as unset, as shells make `VAR=` easy to leave.
                value = os.environ.get(ENV_PREFIX + f.name.upper(), "").strip() or None
                origin = f"environment variable {ENV_PREFIX}{f.name.upper()}"
                if value is not None:
                    from_env.add(f.name)
            if value is None:
                default = _DEFAULTS[f.name]
                value, origin = (default() if callable(default) else default), "default"
            origins[f.name] = origin
            try:
                setattr(self, f.name, _coerce(f.name, value))
            except ValueError as err:
                raise ValueError(f"{err} (value from the {origin})") from None
        self._explicit, self._from_env = frozenset(explicit), frozenset(from_env)
        try:
            self._validate()
        except ValueError as err:  # messages start with "<field>=": say where it came from
            origin = origins.get(str(err).split("=", 1)[0])
            if origin is None:
                raise
            raise ValueError(f"{err} (value from the {origin})") from None

    def _validate(self) -> None:
        if self.plan != "auto" and self.plan not in STRATEGIES and not _is_json_path(self.plan):
            raise ValueError(
                f"plan={self.plan!r} is not valid: {did_you_mean(self.plan, STRATEGIES)}use "
                f"'auto', one of {list(STRATEGIES)}, "
                "or the path of a plan JSON file (ending in .json)"
            )
        if _is_json_path(self.plan) and not Path(self.plan).is_file():
            raise ValueError(f"plan={self.plan!r}: no such plan file; write one with "
                             "`lazytrain plan ... --output PLAN.json`")
        if self.hardware != "auto" and _is_json_path(self.hardware):
            if not Path(self.hardware).is_file():
                raise ValueError(f"hardware={self.hardware!r}: no such hardware JSON file")
        elif self.hardware != "auto" and self.hardware not in HARDWARE_PRESETS:
            raise ValueError(
                f"hardware={self.hardware!r} is not valid: "
                f"{did_you_mean(self.hardware, HARDWARE_PRESETS)}use 'auto', one of "
                f"{sorted(HARDWARE_PRESETS)}, or the path of a hardware JSON file"
            )
        for name in ("gpu_memory_limit_gb", "cpu_memory_limit_gb", "nvme_limit_gb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 = use the "
                                 "hardware profile's capacity)")
        if self.max_recompute_block < 1:
            raise ValueError(f"max_recompute_block={self.max_recompute_block} must be >= 1")
        if self.solver_time_limit_s <= 0:
            raise ValueError(f"solver_time_limit_s={self.solver_time_limit_s} must be > 0")
        if self.max_nonfinite_skips < 1:
            raise ValueError(f"max_nonfinite_skips={self.max_nonfinite_skips} must be >= 1")
        if not self.pin_chunk_max_gib > 0:
            raise ValueError(f"pin_chunk_max_gib={self.pin_chunk_max_gib} must be > 0 (GiB "
                             "page-locked per cudaHostRegister call, e.g. 256)")
        if not 0 < self.replan_min_gain < 1:
            raise ValueError(f"replan_min_gain={self.replan_min_gain} must be between 0 and 1 "
                             "(a fraction of the step, e.g. 0.05 for 5%)")
        if self.threads < 0:
            raise ValueError(f"threads={self.threads} must be >= 0 (0 = sized for this "
                             "machine's free cores, see docs/user_guide.md \"threads\")")
        if self.loss_chunk_tokens != "auto" and self.loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens={self.loss_chunk_tokens} must be >= 0 (0 = the "
                             "model's own loss; e.g. 4096 for the fused chunked loss)")
        if self.checkpoint_max_shard_bytes <= 0:
            raise ValueError(f"checkpoint_max_shard_bytes={self.checkpoint_max_shard_bytes} "
                             "must be > 0 (e.g. 5 * 10**9 for 5 GB shards)")
        if self.checkpoint_write_bytes_per_s < 0:
            raise ValueError(f"checkpoint_write_bytes_per_s={self.checkpoint_write_bytes_per_s}"
                             " must be >= 0 (0 = as fast as the disk takes it)")
        for name in ("batch_size", "seq_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 = size the "
                                 "plan from the data)")
        for name in _CHOICES:
            _check_choice(name, getattr(self, name))
        if self.node_store_dir != ANONYMOUS_SEGMENT and not Path(self.node_store_dir).is_dir():
            raise ValueError(f"node_store_dir={self.node_store_dir!r} is not a directory: use "
                             "'memfd' (an anonymous segment, the default) or an existing "
                             "directory on a shared-memory filesystem (tmpfs, hugetlbfs)")

    def is_explicit(self, name: str) -> bool:
        """True when `name` was passed as an argument (not from env or default)."""
        return name in self._explicit

    def is_default(self, name: str) -> bool:
        """True when `name` holds the built-in default (neither an argument nor the
        environment set it)."""
        return name not in self._explicit and name not in self._from_env

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, enum.Enum) else value
        return out


LazyTrainPlugin = LazyTrainConfig


def _is_json_path(value: str) -> bool:
    return value.endswith(".json") or os.sep in value


_FLOAT_FIELDS = ("gpu_memory_limit_gb", "cpu_memory_limit_gb", "nvme_limit_gb",
                 "solver_time_limit_s", "replan_min_gain", "pin_chunk_max_gib",
                 "checkpoint_write_bytes_per_s")
_INT_FIELDS = ("max_recompute_block", "max_nonfinite_skips", "loss_chunk_tokens",
               "batch_size", "seq_len", "emulate_seed", "threads",
               "checkpoint_max_shard_bytes")
_AUTO_FIELDS = ("loss_chunk_tokens", "overlap_step")  # also accept "auto"
_BOOL_FIELDS = ("emulate_async", "overlap_step")
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False}


def env_setting(name: str) -> Any:
    """Field `name` from `LAZYTRAIN_<NAME>`, else its default, coerced and checked as in
    `LazyTrainConfig` (for code running without a config, e.g. a bare `engine.attach`)."""
    value = os.environ.get(ENV_PREFIX + name.upper(), "").strip()
    if not value:
        default = _DEFAULTS[name]
        return default() if callable(default) else default
    try:
        coerced = _coerce(name, value)
        if name in _CHOICES:
            _check_choice(name, coerced)
    except ValueError as err:
        raise ValueError(f"{err} (value from the environment variable "
                         f"{ENV_PREFIX}{name.upper()})") from None
    return coerced


def _coerce(name: str, value: Any) -> Any:
    """Turn an argument or environment string into the field's type, or raise ValueError."""
    if name == "nvme_dir" and not (isinstance(value, str) and not value.strip()):
        # one directory per drive: a list, or a string joined by ","
        if isinstance(value, str):
            dirs = value.split(drives.DIR_SEPARATOR)
        elif isinstance(value, (list, tuple)):
            dirs = list(value)
        else:
            raise ValueError(f"{name}={value!r} must be a directory, or one per drive as a "
                             f"list or joined by {drives.DIR_SEPARATOR!r}")
        try:
            return drives.join_dirs(dirs)
        except ValueError as err:
            raise ValueError(f"{name}={value!r}: {err}") from None
    if name == "optimizer":
        if isinstance(value, OptimizerChoice):
            return value
        try:
            return OptimizerChoice(str(value).strip().lower())
        except ValueError:
            allowed = [c.value for c in OptimizerChoice]
            raise ValueError(f"optimizer={value!r} is not valid: allowed values are "
                             f"{allowed}") from None
    if name in _AUTO_FIELDS and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if name in _BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word not in _BOOL_WORDS:
            raise ValueError(f"{name}={value!r} must be a boolean (1/0, true/false)")
        return _BOOL_WORDS[word]
    if name in _FLOAT_FIELDS or name in _INT_FIELDS:
        kind = float if name in _FLOAT_FIELDS else int
        if isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be a number")
        what = "a finite number" if kind is float else "an integer"
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={value!r} must be {what}") from None
        # float("nan") and 2.5 for an integer field would otherwise pass silently.
        if not math.isfinite(number) or (kind is int and not number.is_integer()):
            raise ValueError(f"{name}={value!r} must be {what}")
        return kind(number)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}={value!r} must be a non-empty string")
    value = value.strip()
    if (name in ("plan", "hardware") or name in _CHOICES) and not _is_json_path(value):
        return value.lower()  # names ("auto", strategies, presets) are case-insensitive
    return (os.path.expanduser(value) if name in ("cache_dir", "node_store_dir")
            else value)
