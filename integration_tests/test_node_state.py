"""One copy of the training state per node at 4 ranks (issue 45 item 3), at its peak.

`bench/node.py` launches (`accelerate.commands.launch`, `--num_processes`) the same
125M-parameter Llama (16 layers of hidden 768, vocab 8000) at 1 and 4 CPU processes and
samples the ranks' summed PSS through the timed steps; the state is the peak less each
process's bare runtime. The engine's device tier is left out of both: on this CPU device
it is host pages standing for each GPU's memory (two weight slots of one layer each, per
rank; on a GPU node they are not host bytes), and it does not grow with the model's depth.
The 4-rank test is marked `alone`: beside another test's processes the reduces complete
later and the peak rises. The split layout's bar holds beside them (its model counts the
reduce's buffers in flight at their caps): read 0.96x / 1.02x at a load average of 5.7.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import node  # noqa: E402

#: hidden 768, 16 layers, vocab 8000: 125M parameters; 2 timed steps after 1. What a rank
#: holds beyond its share is a few layers' gradients (the layer it runs, one reduce in
#: flight): the same at any depth, and a fixed part of the state only at a fixed depth.
#: At 8 layers of hidden 1024 (117M) each such layer was 1/8 of the gradients and the
#: same code read 1.24-1.31x between launches; at 16 layers, 1.14-1.16x at 4 ranks and
#: 1.05x at 2 (2026-12-06).
MODEL = argparse.Namespace(hidden=768, layers=16, vocab=8000, seq_len=32, global_batch=4,
                           steps=2, warmup=1, mmap_threshold=131072, mixed_precision="no")


def _state_bytes(row: dict) -> int:
    return row["state"] - row["device_tier"]


@pytest.mark.alone
def test_four_ranks_hold_the_state_of_a_125m_model_once(tmp_path: Path) -> None:
    """At most 1.3x one process's state at 4 ranks (the issue's bar; 2 ranks, which read
    1.05x, are measured by `bench/node.py --ranks 1 2 4`, not here: the test runs alone,
    so each launch is CI's wall time). Before the output residents' gradients
    were sent with the first layer's (each rank held the untied head's fp32 gradient
    through the whole backward) and a resident's gradient was copied to send it, the same
    launch measured 1.34x on a 46M model (docs/architecture.md "Several ranks on a
    node", "Gradients")."""
    one = node.launch("lazytrain", 1, MODEL, tmp_path / "one")
    assert one["params"] >= 100e6
    many = node.launch("lazytrain", 4, MODEL, tmp_path / "4")  # 2 ranks: bench/node.py
    ratio = _state_bytes(many) / _state_bytes(one)
    assert ratio <= 1.3, (ratio, _state_bytes(many), _state_bytes(one))


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_a_split_node_holds_its_share_of_the_state(tmp_path: Path,
                                                   mixed_precision: str) -> None:
    """2 simulated nodes x 2 ranks of the same 125M model in the split layout (issue 45):
    each node's peak state (its ranks' summed PSS less their runtime and the device tier)
    against the node model's figure for that layout, what `lazytrain plan --nodes 2`
    prints (less the pinned weight staging a CPU device never allocates), which counts the
    gradient reduce's piece buffers (`host.grads_in_flight_bytes`). fp32 compute (every
    node holds every master, which the GPUs stream): measured 0.94x and 1.00x (2026-12-07,
    pieces sent from where the gradients landed; the first node lower: its own layers'
    gradients land last, when nothing of it is crossing, and the model is the upper bound
    of both). bf16 compute (a node holds the other node's layers as their bf16 compute
    copy alone): 1.07x and 1.04x (1110 and 1081 MB, against 1637 and 1626 MB replicated).
    Before the model counted the reduce's buffers, 1.13-1.24x here and 1.31x once in CI;
    before a reduce's work object stopped holding the buffer it had sent, 1.55x. The bars
    leave this machine's spread room on both sides: a model that over-counts fails too."""
    model = argparse.Namespace(**{**vars(MODEL), "mixed_precision": mixed_precision})
    row = node.launch("lazytrain", 2, model, tmp_path, nodes=2, layout="split")
    for n, measured in enumerate(row["per_node"]):
        ratio = (measured["state"] - measured["device_tier"]) / measured["model"]
        assert 0.85 <= ratio <= 1.2, (n, ratio, measured)
