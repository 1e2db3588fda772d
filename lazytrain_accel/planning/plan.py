"""`Plan`: the planner's output and the engine's input, as a versioned JSON document.

Indexing (shared by the MIP, the simulator and the engine):

* Layers j = 1..L. Boundary i = 0..L is the hidden state entering layer i+1 (i = 0 is the
  embedding output) or leaving layer i (i = L feeds the final norm and head).
* Windows, in execution order: forward window of layer j is ``j - 1`` (F_1..F_L), the
  backward window of layer j is ``2L - j`` (B_L..B_1). A window lasts as long as its
  layer's compute.
* A boundary's home is where it lives between its forward and the backward that needs it
  (boundary i is read by layer i+1's backward): GPU, CPU, NVMe, or RECOMPUTE (not kept;
  regenerated in backward from the block's first boundary). Boundaries 0 and L are GPU.
* `blocks` are the path edges (s, e): consecutive materialized boundaries; the boundaries
  strictly between s and e are recomputed.
"""

from __future__ import annotations

import enum
import itertools
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PLAN_FORMAT_VERSION = 1

#: Where the residents' (embeddings, final norm, head) masters and 8-bit moments live and
#: their update runs (`Plan.resident_update`): with every other parameter on the host, or
#: on the GPU, updated there before the next forward while the host updates the layers.
RESIDENT_UPDATES: tuple[str, ...] = ("host", "device")
#: How the host state spreads over the nodes (`Plan.node_layout`; planning/node.py):
#: "split", each node holds the compute copy of every layer and 1/K of the masters,
#: moments and gradients; "replicated", each node holds all of it.
NODE_LAYOUTS: tuple[str, ...] = ("split", "replicated")


#: How each streamed layer runs over a long sequence (`Plan.tiling`), in tiles of
#: `Plan.tile_tokens` tokens: "none": whole, one attention call over the sequence; "mlp":
#: its token-wise parts (MLP, MoE experts) in tiles, attention over the whole sequence
#: (`engine/sequence/tiles.py`); "layer": the whole layer in sequence tiles, each tile's
#: queries attending to the key prefix (`engine/sequence/layer_tiles.py`), or, for a layer
#: that cannot run in tiles, the layer whole with its MLP in tiles and its attention in
#: query blocks of the tile's size (`engine/sequence/query_blocks.py`).
TILINGS: tuple[str, ...] = ("none", "mlp", "layer")


def tiling_of(tile_tokens: int, attention_block_tokens: int) -> tuple[str, int]:
    """(tiling, tile_tokens) of a profile's two sizes (`ModelProfile.tile_tokens`,
    `attention_block_tokens`; a plan file of before `Plan.tiling` stored them too): query
    blocks make it "layer" tiles of their size, MLP tiles alone "mlp"."""
    if attention_block_tokens and tile_tokens not in (0, attention_block_tokens):
        raise PlanError(f"tile_tokens={tile_tokens} with attention_block_tokens="
                        f"{attention_block_tokens}: a plan tiles the whole layer in one size; "
                        "re-run `lazytrain plan`")
    if attention_block_tokens:
        return "layer", attention_block_tokens
    return ("mlp", tile_tokens) if tile_tokens else ("none", 0)


class Home(str, enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"
    RECOMPUTE = "recompute"


class TransferKind(str, enum.Enum):
    D2H = "d2h"  # device -> host (offload of a CPU or NVMe boundary)
    NVME_WRITE = "nvme_write"  # host -> NVMe file
    NVME_READ = "nvme_read"  # NVMe file -> host
    H2D = "h2d"  # host -> device (reload before the backward that reads it)


class PlanError(ValueError):
    """A plan file is unreadable, of another format version, or for another run."""


def forward_window(layer: int, num_layers: int) -> int:
    """Window index of layer `layer`'s (1-based) forward."""
    if not 1 <= layer <= num_layers:
        raise ValueError(f"layer={layer} outside 1..{num_layers}")
    return layer - 1


def backward_window(layer: int, num_layers: int) -> int:
    """Window index of layer `layer`'s (1-based) backward."""
    if not 1 <= layer <= num_layers:
        raise ValueError(f"layer={layer} outside 1..{num_layers}")
    return 2 * num_layers - layer


#: The parts of a decoder layer's host state the planner may home on NVMe
#: (`StateHomes`): its fp32 master with its optimizer moments (read before the layer's
#: update, written after it), its fp32 gradient (written as it arrives in the backward,
#: read by the update) and its compute-dtype copy (written by the update, read before the
#: layer's backward). docs/planner.md "Host state on NVMe".
STATE_PARTS: tuple[str, ...] = ("optimizer", "grads", "copies")


@dataclass(kw_only=True, frozen=True)
class StateHomes:
    """The decoder layers (1-based) whose state part lives on NVMe, per `STATE_PARTS`;
    every other layer's part, and the residents' state, lives in host DRAM."""

    optimizer: tuple[int, ...] = ()
    grads: tuple[int, ...] = ()
    copies: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for part in STATE_PARTS:
            layers = getattr(self, part)
            if list(layers) != sorted(set(layers)) or any(
                    isinstance(j, bool) or not isinstance(j, int) or j < 1 for j in layers):
                raise PlanError(f"state homes {part}={layers!r}: give increasing layer "
                                "numbers >= 1")
            object.__setattr__(self, part, tuple(layers))

    @property
    def any(self) -> bool:
        """Whether any state lives on NVMe."""
        return any(getattr(self, part) for part in STATE_PARTS)

    def on_nvme(self, part: str, layer: int) -> bool:
        return layer in getattr(self, part)

    def to_dict(self) -> dict[str, list[int]]:
        return {part: list(getattr(self, part)) for part in STATE_PARTS}


@dataclass(kw_only=True)
class Transfer:
    """`bytes` of boundary `boundary` moved by `kind` during window `window`."""

    boundary: int
    kind: TransferKind
    window: int
    bytes: int


@dataclass(kw_only=True)
class Prediction:
    """What the cost model predicts for one training step (one micro-batch)."""

    step_s: float
    compute_s: float  # forward + backward compute, recompute excluded
    recompute_s: float
    exposed_s: float  # communication the compute does not hide
    exposed_by_link_s: dict[str, float] = field(default_factory=dict)
    peak_gpu_bytes: int = 0
    peak_cpu_bytes: int = 0
    peak_nvme_bytes: int = 0
    tokens_per_s: float = 0.0
    tflops: float = 0.0  # paper convention: 6 * params * tokens / step_s
    # The host optimizer's update overlapped with the next step (0 when not simulated):
    # seconds the next forward waited for it, included in step_s and exposed_s.
    optimizer_exposed_s: float = 0.0
    # The engine's per-layer-run overhead (hooks, weight acquire, gradient hand-off, the
    # Python between layers), in step_s, not in compute_s or recompute_s.
    overhead_s: float = 0.0
    # The host's work per transfer where it takes the compute's time (a CPU or emulated
    # device: weights staged, gradients folded), in step_s, not in compute_s.
    host_s: float = 0.0


@dataclass(kw_only=True, frozen=True)
class Solution:
    """What a strategy decided for one `Problem`, from the MIP or a fixed baseline: one
    frozen type for every strategy (a status change is `dataclasses.replace`), and what a
    `Plan` keeps of its solve (`Plan.solver`, whose homes are the plan's)."""

    status: str  # "optimal", "gaplimit", "timelimit", "baseline", "fallback", "infeasible"
    homes: tuple[Home, ...] | None  # None when no feasible point was found
    exposed_s: tuple[float, ...] = ()  # per window, what the links add to its compute
    objective_s: float | None = None  # recompute + stalls + exposure (+ tie-breakers)
    gap: float = 0.0  # (incumbent - bound) / predicted step
    solve_s: float = 0.0
    shortfall_bytes: Mapping[str, int] = field(default_factory=dict)  # per binding tier
    message: str = ""
    # When a plan the simulator priced faster replaced the MIP's pick (`make_plan`): its
    # name ("megatrain", ..., "running": the plan a re-plan runs now), and the MIP's
    # pick's simulated step; "" and None when the MIP's pick was kept.
    mip_lost_to: str = ""
    mip_step_s: float | None = None
    # The host state's homes where the MIP decided them (`Problem.decide_state`); None:
    # the problem's own (a plan keeps them as `Plan.state`).
    state: StateHomes | None = None
    # Where the host state did not fit DRAM: each state candidate's simulated step by name
    # (`state_search.CANDIDATE_NAMES`; None where it did not fit), the fastest over the
    # profiles `make_plan` planned (`solve.plan_host_state`); empty where none was priced.
    state_steps_s: Mapping[str, float | None] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.homes is not None and not self.shortfall_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON fields, the homes left out (a plan file holds them once, as `homes`)."""
        return {"status": self.status, "exposed_s": list(self.exposed_s),
                "state": None if self.state is None else self.state.to_dict(),
                "objective_s": self.objective_s, "gap": self.gap, "solve_s": self.solve_s,
                "shortfall_bytes": dict(self.shortfall_bytes), "message": self.message,
                "mip_lost_to": self.mip_lost_to, "mip_step_s": self.mip_step_s,
                "state_steps_s": dict(self.state_steps_s)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], homes: list[Home]) -> Solution:
        state = data.get("state")
        return cls(**{**data, "homes": tuple(homes),
                      "exposed_s": tuple(data.get("exposed_s", ())),
                      "state": None if state is None else StateHomes(
                          **{k: tuple(v) for k, v in state.items()})})


@dataclass(kw_only=True)
class Plan:
    strategy: str
    num_layers: int
    batch_size: int
    seq_len: int
    boundary_bytes: int
    homes: list[Home]  # length num_layers + 1
    blocks: list[tuple[int, int]]
    transfers: list[Transfer]
    prediction: Prediction
    solver: Solution  # the solve the homes came from
    fingerprint: str
    # Tokens per chunk of the fused chunked loss the plan was made for (0: the model's
    # own loss, full logits); with loss_chunk_tokens="auto" the engine follows it.
    loss_chunk_tokens: int = 0
    # Where the residents' update runs (`RESIDENT_UPDATES`); a plan file without it: host.
    resident_update: str = "host"
    # The host optimizer whose state the plan's host bytes price ("hybrid8bit" or "keep",
    # planning/host.py); a plan file without it: hybrid8bit.
    optimizer: str = "hybrid8bit"
    # How each streamed layer runs over the sequence (`TILINGS`) and the tile's tokens (0
    # exactly when "none"). A plan file without them: "none"; one with the older
    # `attention_block_tokens` is read through `tiling_of`.
    tiling: str = "none"
    tile_tokens: int = 0
    # The node shape the plan was made for: local ranks sharing one host (each runs this
    # plan; the host bytes in `prediction` are the node's, the tokens/s one rank's) and
    # nodes. A plan file without them: one GPU.
    gpus_per_node: int = 1
    nodes: int = 1
    # How the host state spreads over the nodes (`node.NODE_LAYOUTS`: the host bytes in
    # `prediction` are a node's either way). A plan file without it: replicated.
    node_layout: str = "replicated"
    # The decoder layers whose host state lives on NVMe (`StateHomes`); a plan file
    # without it: all in DRAM.
    state: StateHomes = field(default_factory=StateHomes)
    version: int = PLAN_FORMAT_VERSION

    def __post_init__(self) -> None:
        self.homes = [Home(h) for h in self.homes]
        if isinstance(self.state, dict):
            self.state = StateHomes(**{k: tuple(v) for k, v in self.state.items()})
        self.blocks = [tuple(b) for b in self.blocks]
        self.transfers = [
            t if isinstance(t, Transfer) else Transfer(**{**t, "kind": TransferKind(t["kind"])})
            for t in self.transfers
        ]
        self._check_consistent()

    def _check_consistent(self) -> None:
        if self.tiling not in TILINGS:
            raise PlanError(f"plan tiling={self.tiling!r} is not one of {TILINGS}")
        if (isinstance(self.tile_tokens, bool) or not isinstance(self.tile_tokens, int)
                or self.tile_tokens < 0 or (self.tile_tokens == 0) != (self.tiling == "none")):
            raise PlanError(f"plan tile_tokens={self.tile_tokens!r} with tiling="
                            f"{self.tiling!r}: tile_tokens is an integer, 0 exactly when the "
                            "tiling is 'none'")
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"plan {name}={value!r} must be an integer >= 1")
        if self.solver.homes is None or list(self.solver.homes) != self.homes:
            raise PlanError("plan solver homes differ from the plan's: build a plan from its "
                            "solution (`solve.plan_from_solution`) or replace both")
        if any(j > self.num_layers for part in STATE_PARTS for j in getattr(self.state, part)):
            raise PlanError(f"plan state homes {self.state.to_dict()} name a layer past "
                            f"{self.num_layers}")
        if self.node_layout not in NODE_LAYOUTS:
            raise PlanError(f"plan node_layout={self.node_layout!r} is not one of "
                            f"{NODE_LAYOUTS}")
        if self.resident_update not in RESIDENT_UPDATES:
            raise PlanError(f"plan resident_update={self.resident_update!r} is not one of "
                            f"{RESIDENT_UPDATES}")
        L = self.num_layers
        if len(self.homes) != L + 1:
            raise PlanError(f"plan has {len(self.homes)} homes for {L} layers; expected {L + 1}")
        if self.homes[0] != Home.GPU or self.homes[L] != Home.GPU:
            raise PlanError("boundaries 0 and L must be homed on the GPU")
        materialized = [i for i, h in enumerate(self.homes) if h != Home.RECOMPUTE]
        expected = list(itertools.pairwise(materialized))
        if self.blocks != expected:
            raise PlanError(f"plan blocks {self.blocks} do not match its homes "
                            f"(expected {expected})")

    # ---- queries the engine and the reports use -------------------------------------
    def block_of(self, boundary: int) -> tuple[int, int]:
        """The block (s, e) with s <= boundary < e (the block whose start regenerates it)."""
        for s, e in self.blocks:
            if s <= boundary < e:
                return s, e
        raise ValueError(f"boundary {boundary} is not inside any block of this plan")

    @property
    def recomputed_layer_runs(self) -> int:
        """Layer forwards the backward re-runs per step: block (s, e) regenerates the
        e - s - 1 boundaries inside it."""
        return sum(e - s - 1 for s, e in self.blocks)

    @property
    def attention_block_tokens(self) -> int:
        """Tokens per attention query block: the tile under "layer" tiling (a tiled layer's
        tiles are its query blocks), 0 otherwise (one call over the whole sequence)."""
        return self.tile_tokens if self.tiling == "layer" else 0

    def count_homes(self) -> dict[str, int]:
        return {h.value: sum(1 for x in self.homes if x == h) for h in Home}

    def transfers_in(self, window: int) -> list[Transfer]:
        return [t for t in self.transfers if t.window == window]

    # ---- JSON ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["homes"] = [h.value for h in self.homes]
        out["blocks"] = [list(b) for b in self.blocks]
        out["transfers"] = [{**asdict(t), "kind": t.kind.value} for t in self.transfers]
        out["solver"] = self.solver.to_dict()
        out["state"] = self.state.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise PlanError("a plan must be a JSON object")
        version = data.get("version")
        if version != PLAN_FORMAT_VERSION:
            raise PlanError(f"plan format version {version!r} is not supported (this release "
                            f"reads version {PLAN_FORMAT_VERSION}); re-run `lazytrain plan`")
        try:
            fields = dict(data)
            if "attention_block_tokens" in fields:  # a plan file of before `tiling`
                fields["tiling"], fields["tile_tokens"] = tiling_of(
                    fields.get("tile_tokens", 0), fields.pop("attention_block_tokens"))
            fields["prediction"] = Prediction(**data["prediction"])
            fields["solver"] = Solution.from_dict(data["solver"],
                                                  [Home(h) for h in data["homes"]])
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, PlanError):
                raise
            raise PlanError(f"plan JSON is incomplete or malformed ({err}); re-run "
                            "`lazytrain plan --output PLAN.json`") from err

    def save(self, path: str | Path) -> None:
        """Write the plan to `path` whole: through a temporary file of this writer's own,
        renamed into place, so writers of the same path (the ranks of a launch filling one
        plan cache) never take each other's file, and a reader never sees half of one."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_dict(), indent=1))
            os.chmod(tmp, 0o644)  # as a plain open() would leave it, not mkstemp's 0600
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"plan file {str(path)!r} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise PlanError(f"plan file {str(path)!r} is not valid JSON (truncated or "
                            f"corrupted: {err}); re-run `lazytrain plan --output`") from None
        return cls.from_dict(data)

    def check_fingerprint(self, expected: str) -> None:
        if self.fingerprint != expected:
            raise PlanError(
                f"this plan was made for another run (plan fingerprint {self.fingerprint[:12]}, "
                f"this run {expected[:12]}): model geometry, batch size, sequence length, "
                "compute dtype (mixed_precision; `lazytrain plan --dtype`) or hardware "
                "differ; plan again for this run or use plan='auto'"
            )
