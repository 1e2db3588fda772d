"""engine/memory/quantized.py: packed bitsandbytes weights stream as stored. On the emulated async
device (the CUDA code path: staging, H2D side stream, events) a layer's packed bytes and
scales go through the same staging, waits and slot events as its float parameters, and a
QLoRA run equals the synchronous one exactly; a packed copy the compute does not wait for
reads poisoned bytes. The host tensors are never written. A real H2D copy needs a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import batches, make_plan

from lazytrain_accel.engine import attach
from lazytrain_accel.engine.device.emulation import EmulatedStreams, EmulationSettings
from lazytrain_accel.engine.memory import quantized

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).parents[1] / "qa"))
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

from test_qa_qlora import qlora  # noqa: E402

CPU = torch.device("cpu")


def _packed_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if quantized.is_packed(p)}


def _train(model: torch.nn.Module, tmp_path: Path, emulation: EmulationSettings | bool,
           steps: int = 2, num_layers: int = 4) -> tuple[list[float], object]:
    engine = attach(model, make_plan("megatrain", num_layers), device=CPU, nvme_dir=str(tmp_path),
                    emulation=emulation)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for ids in batches(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, engine


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_qlora_on_the_emulated_async_device_equals_the_synchronous_run(tmp_path: Path,
                                                                       quant_type: str) -> None:
    sync_model = qlora(quant_type)
    host = {n: p.data.clone() for n, p in _packed_params(sync_model).items()}
    sync_losses, sync_engine = _train(sync_model, tmp_path / "sync", False)
    assert not sync_engine.streams.is_async
    for seed in (0, 1):
        model = qlora(quant_type)
        packed = {n: (p.data_ptr(), p.quant_state.absmax)
                  for n, p in _packed_params(model).items()}
        losses, engine = _train(model, tmp_path / f"emulated{seed}",
                                EmulationSettings(seed=seed))
        assert isinstance(engine.streams, EmulatedStreams)
        assert isinstance(engine.pool, quantized.PackedWeightPool)
        assert losses == sync_losses, seed
        for (name, p), q in zip(model.named_parameters(), sync_model.parameters(),
                                strict=True):
            assert torch.equal(p, q), (seed, name)
        for name, p in _packed_params(model).items():  # pointed back at the untouched host
            data_ptr, absmax = packed[name]
            assert p.data_ptr() == data_ptr and p.quant_state.absmax is absmax, name
            assert torch.equal(p.data, host[name]), name
        engine.detach()


def test_a_replan_that_adds_a_weight_slot_gives_it_a_byte_slot(tmp_path: Path) -> None:
    # offload_all runs with two weight slots, megatrain (recompute) with three: the packed
    # pool grows a byte slot and its staging with each float slot.
    runs = {}
    for name, emulation in (("sync", False), ("emulated", EmulationSettings(seed=4))):
        model = qlora("nf4")
        engine = attach(model, make_plan("offload_all", 4), device=CPU,
                        nvme_dir=str(tmp_path / name), emulation=emulation)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step, ids in enumerate(batches(3)):
            if step == 1:
                engine.set_plan(make_plan("megatrain", 4))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[name] = losses
        assert engine.pool.num_slots == 3
        if emulation:
            assert len(engine.pool._packed_slots) == len(engine.pool._packed_staging) == 3
        engine.detach()
    assert runs["emulated"] == runs["sync"]


def test_int8_on_the_emulated_async_device_equals_the_synchronous_run(tmp_path: Path) -> None:
    """LLM.int8: `Linear8bitLt` moves the weight's CB/SCB into its module state at each
    forward; the pool hands it the slot's copies every time and the host ones back."""
    import peft
    from test_qa_qlora import TARGETS, build

    from lazytrain_accel.engine.memory.quantize_base import quantize_frozen_linears

    def int8_lora() -> torch.nn.Module:
        model = peft.get_peft_model(build("llama"), peft.LoraConfig(
            r=4, target_modules=TARGETS, lora_dropout=0.0))
        quantize_frozen_linears(model, "int8")
        return model

    sync_losses, _ = _train(int8_lora(), tmp_path / "sync", False)
    model = int8_lora()
    scales = {n: p.SCB for n, p in _packed_params(model).items()}
    losses, engine = _train(model, tmp_path / "emulated", EmulationSettings(seed=2))
    assert isinstance(engine.streams, EmulatedStreams) and losses == sync_losses
    for name, p in _packed_params(model).items():
        assert p.SCB is scales[name] and p.CB.data_ptr() == p.data_ptr(), name


def test_a_packed_copy_the_compute_does_not_wait_for_reads_poison(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The slot's load event must cover the packed copy: with the float copy's event kept
    instead, compute reads packed bytes still in flight (long worker delays before each
    copy: poisoned, 0xA5 bytes and NaN scales)."""
    load = quantized.PackedWeightPool._load_packed

    def unchained(self, layer: int, slot: int) -> None:
        float_event = self._slot_loaded[slot]
        load(self, layer, slot)
        self._slot_loaded[slot] = float_event

    monkeypatch.setattr(quantized.PackedWeightPool, "_load_packed", unchained)
    model = qlora()
    reference = qlora()
    ids = batches(1)[0]
    expected = reference(input_ids=ids, labels=ids).loss
    attach(model, make_plan("megatrain", 4), device=CPU, nvme_dir=str(tmp_path),
           emulation=EmulationSettings(seed=3, jitter_s=0.05))
    assert model(input_ids=ids, labels=ids).loss != expected


@pytest.mark.parametrize("hidden_size", [64, 512])
def test_an_eval_mode_repack_reaches_the_host_master_on_the_emulated_device(
        tmp_path: Path, hidden_size: int) -> None:
    """Eval mode on a CPU with AVX512-BF16: bitsandbytes repacks the slot's copy of layer 1's
    q/k/v for its inference kernel (their input needs no grad); the pool repacks their host
    masters the same way and lays out their bytes anew (at 512 wide the bf16 absmax outgrows
    the nested one: the byte slots grow), so the emulated run equals the synchronous one,
    whose masters repack in place as a stock run's do."""
    if not bnb.functional.has_avx512bf16():
        pytest.skip("no AVX512-BF16 on this CPU: bitsandbytes has no CPU inference kernel")
    runs = {}
    for name, emulation in (("sync", False), ("emulated", EmulationSettings(seed=5))):
        model = qlora(wide=True, hidden_size=hidden_size).eval()
        losses, engine = _train(model, tmp_path / name, emulation, num_layers=2)
        runs[name] = losses, model, engine
    (losses, model, engine), (sync_losses, sync_model, _) = runs["emulated"], runs["sync"]
    assert isinstance(engine.pool, quantized.PackedWeightPool) and losses == sync_losses
    for (name, p), q in zip(model.named_parameters(), sync_model.parameters(), strict=True):
        assert p.shape == q.shape and torch.equal(p, q), name
    flags = {}
    for name, p in _packed_params(model).items():
        state, sync_state = p.quant_state, dict(_packed_params(sync_model))[name].quant_state
        flags[name] = getattr(state, "packing_format_for_cpu", False)
        assert flags[name] == getattr(sync_state, "packing_format_for_cpu", False), name
        assert torch.equal(state.absmax, sync_state.absmax), name
    assert sorted(n.split("layers.")[1].split(".")[:3:2] for n, f in flags.items() if f) == [
        ["0", "k_proj"], ["0", "q_proj"], ["0", "v_proj"]]  # layer 1 (0 in HF's names)
    first, second = engine.pool._layer_slot_bytes
    assert (first > second) == (hidden_size == 512)
    assert engine.pool._packed_slot_bytes == (first if hidden_size == 512 else second)
    engine.detach()
