"""The per-layer-run overhead of the streaming engine on this machine (run as a program).

    python -m lazytrain_accel.profiling.layer_probe [--device cpu] [--threads N]

prints `{"forward_s": ..., "backward_s": ...}`: the seconds a layer's forward run (a
forward or a recompute re-run) and its backward run (re-run with grad + backward) cost
beyond the time the engine times as that layer's compute (`StepStats.compute_s`). That is
the engine's work around each layer (weight acquire and prefetch issue, boundary
placement, the autograd Function, the gradient hand-off) and the Python between layers:
work no FLOP count prices, which `HardwareProfile.layer_forward_overhead_s` /
`layer_backward_overhead_s` carry into the cost model (`planning/problem.py`).

How: two models of tiny decoder layers (hidden 16, 4 tokens: their compute is almost
nothing) run a training step through the real engine (`attach`, every boundary on the
device, no recompute) on `device`; the difference of the two models' forward (and
backward) wall time minus the difference of their timed layer compute, per extra layer,
is the overhead. Medians of interleaved repeats, so a change of machine load hits both.

A program, not an import of `measure.py`: the engine imports the planner, which imports
`profiling`, so `profiling/measure.py` runs this module in a subprocess (nothing in the
package imports it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

#: Decoder depths of the probe's two models; the overhead is their difference per layer.
PROBE_LAYERS = (2, 8)
_GIB = 2**30


@dataclass(frozen=True)
class LayerOverheads:
    forward_s: float  # one forward run of a layer (forward or recompute re-run)
    backward_s: float  # one backward run (its re-run with grad and the backward)


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
        from lazytrain_accel.profiling.models import geometry_from_config, profile_model

        self.model = _tiny_model(layers)
        profile = profile_model(geometry_from_config(self.model.config.to_dict()),
                                batch_size=1, seq_len=4, compute_bytes_per_elem=4)
        plan = make_plan(profile, _probe_hardware(), PlanRequest(strategy="checkpoint_all"))
        self.engine = attach(self.model, plan, device=device, emulation=emulation)
        self.device = device
        self.ids = torch.randint(0, 64, (1, 4), device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> tuple[float, float, float, float]:
        """(forward wall s, its timed layer compute s, backward wall s, its compute s)."""
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
        self.model.zero_grad(set_to_none=True)
        return forward_s, forward_compute_s, backward_s, backward_compute_s


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
        forward, backward = [], []
        extra = PROBE_LAYERS[1] - PROBE_LAYERS[0]
        for _ in range(repeats):
            a, b = self.small.step(), self.large.step()
            forward.append(((b[0] - b[1]) - (a[0] - a[1])) / extra)
            backward.append(((b[2] - b[3]) - (a[2] - a[3])) / extra)
        return LayerOverheads(forward_s=max(statistics.median(forward), 0.0),
                              backward_s=max(statistics.median(backward), 0.0))

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
    print(json.dumps({"forward_s": result.forward_s, "backward_s": result.backward_s}))


if __name__ == "__main__":
    main()
