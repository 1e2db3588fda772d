"""The per-layer-run overhead of the streaming engine on this machine (run as a program).

    python -m lazytrain_accel.layer_probe [--device cpu] [--threads N]

prints `{"forward_s": ..., "backward_s": ..., "step_s": ...}`: what a layer's forward run
and backward run cost beyond the compute the engine times for them, and what a step costs
besides its layers (`HardwareProfile.layer_*_overhead_s`, `step_overhead_s`). Two models
of tiny decoder layers train through the real engine; the difference of their wall time
less their timed compute, per extra layer, is the per-run overhead (medians of interleaved
repeats). It imports the engine, the planner and `optim`, so `profiling/measure.py` runs
it in a subprocess and nothing imports it. Docs: docs/planner.md "The step as windows".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from lazytrain_accel.optim import HybridAdamW8bit

#: Decoder depths of the probe's two models; the overhead is their difference per layer.
PROBE_LAYERS = (2, 8)
_GIB = 2**30


@dataclass(frozen=True)
class LayerOverheads:
    forward_s: float  # one forward run of a layer (forward or recompute re-run)
    backward_s: float  # one backward run (its re-run with grad and the backward)
    step_s: float = 0.0  # once per step, besides the layers (embedding, head, optimizer call)


def _tiny_model(layers: int):
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=layers, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64,
                                   max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).train()


def _probe_hardware():
    from lazytrain_accel.profiling.hardware import HardwareProfile

    # Links and rates far above the probe's needs: the plan keeps every boundary home.
    return HardwareProfile(
        name="layer-probe", gpu_name="probe", gpu_memory_bytes=64 * _GIB,
        cpu_memory_bytes=64 * _GIB, nvme_bytes=64 * _GIB, peak_bf16_flops_per_s=1e12,
        achieved_flops_per_s=1e12, h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12,
        nvme_read_bytes_per_s=1e12, nvme_write_bytes_per_s=1e12,
        cpu_optimizer_params_per_s=1e9, source="layer probe")


class _Probe:
    """One tiny model streamed by the engine; times its forward and backward."""

    def __init__(self, layers: int, device: torch.device, emulation) -> None:
        from lazytrain_accel.engine import attach
        from lazytrain_accel.planning import make_plan
        from lazytrain_accel.planning.request import PlanRequest
        from lazytrain_accel.profiling.model_configs import geometry_from_config, profile_model

        self.model = _tiny_model(layers)
        profile = profile_model(geometry_from_config(self.model.config.to_dict()),
                                batch_size=1, seq_len=4, compute_bytes_per_elem=4)
        plan = make_plan(profile, _probe_hardware(), PlanRequest(strategy="checkpoint_all"))
        self.engine = attach(self.model, plan, device=device, emulation=emulation)
        self.optimizer = HybridAdamW8bit(self.model.parameters(), lr=1e-4)
        self.device = device
        self.ids = torch.randint(0, 64, (1, 4), device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> tuple[float, float, float, float, float]:
        """(forward wall s, its timed layer compute s, backward wall s, its compute s,
        the optimizer call's wall s); the update itself is waited for after it."""
        self.engine.reset_stats()
        start = time.perf_counter()
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        self._sync()
        forward_s, forward_compute_s = time.perf_counter() - start, self.engine.stats().compute_s
        start = time.perf_counter()
        loss.backward()
        self._sync()
        backward_s = time.perf_counter() - start
        backward_compute_s = self.engine.stats().compute_s - forward_compute_s
        start = time.perf_counter()
        self.engine.step_layerwise(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - start
        self.engine.synchronize()  # the update's own run is the optimizer rate's, not this
        return forward_s, forward_compute_s, backward_s, backward_compute_s, optimizer_s


class LayerOverheadProbe:
    """The probe's two engines, kept for repeated measurements (`bench/fidelity.py`
    measures once per round); `close()` detaches them."""

    def __init__(self, device: torch.device, *, emulation=False) -> None:
        self.small, self.large = (_Probe(n, device, emulation) for n in PROBE_LAYERS)
        for probe in (self.small, self.large):  # warm-up: lazy init, allocator
            for _ in range(3):
                probe.step()

    def measure(self, repeats: int = 15) -> LayerOverheads:
        """Medians of `repeats` interleaved steps of both engines."""
        forward, backward, outside = [], [], []
        extra = PROBE_LAYERS[1] - PROBE_LAYERS[0]
        for _ in range(repeats):
            a, b = self.small.step(), self.large.step()
            forward.append(((b[0] - b[1]) - (a[0] - a[1])) / extra)
            backward.append(((b[2] - b[3]) - (a[2] - a[3])) / extra)
            outside.append((a[0] - a[1]) + (a[2] - a[3]) + a[4])  # the small step's rest
        forward_s = max(statistics.median(forward), 0.0)
        backward_s = max(statistics.median(backward), 0.0)
        runs_s = PROBE_LAYERS[0] * (forward_s + backward_s)
        return LayerOverheads(forward_s=forward_s, backward_s=backward_s,
                              step_s=max(statistics.median(outside) - runs_s, 0.0))

    def close(self) -> None:
        for probe in (self.small, self.large):
            probe.engine.detach()


def measure_layer_overheads(device: torch.device, *, emulation=False,
                            repeats: int = 15) -> LayerOverheads:
    """The engine's per-layer-run overhead on `device` (`emulation`: the engine's backend
    on a CPU, as `attach` takes it)."""
    probe = LayerOverheadProbe(device, emulation=emulation)
    try:
        return probe.measure(repeats)
    finally:
        probe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: keep)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    result = measure_layer_overheads(torch.device(args.device), repeats=args.repeats)
    print(json.dumps({"forward_s": result.forward_s, "backward_s": result.backward_s,
                      "step_s": result.step_s}))


if __name__ == "__main__":
    main()
