"""engine/quantized.py: packed bitsandbytes weights move as stored (data and scales) while
a layer runs and point back at the untouched host tensors afterwards; the per-layer swap
(what a CUDA device takes) trains exactly like the in-place path (what a CPU device takes).
On this CPU the swap's `.to("cpu")` copies no byte: a real H2D copy needs a GPU run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lazytrain_accel.engine import quantized

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).parents[1] / "qa"))
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _packed_linear() -> torch.nn.Module:
    torch.manual_seed(0)
    linear = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32)
    linear.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False)
    return linear.to("cpu")


def test_packed_to_and_restore_leave_the_host_tensors_untouched() -> None:
    linear = _packed_linear()
    p = linear.weight
    data_ptr, state, absmax = p.data_ptr(), p.quant_state, p.quant_state.absmax
    assert quantized.is_packed(p) and not quantized.is_packed(torch.nn.Parameter(
        torch.zeros(2)))
    x = torch.randn(3, 64)
    expected = linear(x)
    saved = quantized.packed_to(p, torch.device("cpu"))  # same device: no byte copied
    assert p.quant_state is not state and p.quant_state.state2 is not state.state2
    assert torch.equal(linear(x), expected)  # bitsandbytes computes with the moved state
    quantized.restore(p, saved)
    assert p.data_ptr() == data_ptr and p.quant_state is state and state.absmax is absmax


def test_copying_path_trains_like_stock(tmp_path: Path, monkeypatch) -> None:
    from qa_helpers import plugin, train
    from test_qa_qlora import qlora

    init = quantized.PackedWeightPool.__init__

    def copying(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self._in_place = False  # move packed weights per layer, as on a CUDA device

    monkeypatch.setattr(quantized.PackedWeightPool, "__init__", copying)
    stock = train(qlora(), None)
    ours = train(qlora(), plugin(tmp_path, "offload_all", optimizer="keep"))
    assert ours.losses == stock.losses
    for name, value in stock.params.items():
        torch.testing.assert_close(ours.params[name], value, rtol=0, atol=0, msg=name)
