"""Plan fidelity on a CPU: `planning.simulate`'s step against the engine's, on throttled
emulated links (engine/device/emulation.py).

For each model (the demo's Qwen2 shape; a 12-layer, 116M-parameter Qwen2) and plan (auto,
megatrain, offload_all, and an auto plan whose tight device and host budgets home
boundaries on NVMe):

1. Compute is measured on this CPU, not taken from a GPU preset: the engine (synchronous
   backend, every boundary on the device) is timed forward and backward; a layer's forward
   seconds, its backward seconds (re-run included) and the rest of the step (embeddings,
   head, loss, weight copies) become the model profile's FLOPs at a nominal 1 TFLOP/s.
   Residents are used in place on a CPU, so the profile streams none (no device copy:
   no gradients of theirs leave the device either, `problem.resident_tail_d2h_bytes`).
   The engine's
   per-layer-run overhead (layer_probe.py: tiny layers through the engine) is
   measured beside it, on the synchronous backend (taken out of the rest) and on the
   emulated one the plans run on (the hardware profile's `layer_*_overhead_s`).
2. The emulated device runs without poisoning copies' destinations at issue
   (`poison_copies=False`: that fill is a memset of every byte moved, on the training
   thread, which a GPU's copies do not cost; the tests keep it, it proves the waits).
   Links get rates that make transfers comparable to that compute (H2D: a layer's weights
   in `H2D_FORWARDS` layer forwards, ...); the hardware profile holds them, the plans are
   made for it and the emulation throttles each link to exactly that rate (no jitter).
3. Each plan runs on the emulated device in rounds; a round times, back to back, the
   compute (step 1 again) and both overheads, the plan on throttled links, and the same
   with HybridAdamW8bit overlapped by `step_layerwise`, each as the median of `--steps`
   runs (one run moves by 10-15% on this 2-core machine). The compute is timed in turns
   alone and beside the HybridAdamW8bit update of the model, run as a step runs it (the
   engine's update thread, each group's gradients freed after its update): that gives
   the round's host optimizer rate and the seconds the update takes from a step's
   compute on this CPU, where both share the cores and the memory (a GPU's compute does
   not; the simulator charges them once per step, with the rest). The prediction of a
   round simulates the plan on that round's compute, overhead and update rate (the step
   with the optimizer on the compute beside the update), so a change of machine load
   between rounds moves both sides; the row shown is the round with the median step
   ratio (the spread of both ratios over the rounds follows it). "update" is the host
   update's seconds, first op to last: simulated, and as its thread ran inside the step
   (the residents' update on the device runs beside it, on the training thread: the
   emulated device is async, `device_runs_async`). A step's measured
   compute is its layers' compute as the engine timed it inside that step plus the
   round's calibrated rest and the plan's layer runs at the round's emulated overhead
   (the predicted compute holds them too). The exposed term is measured two ways:
   "waited", the seconds the training thread was blocked on a wait (the engine's
   `stall_s`: on the emulated device compute is that thread, so a wait on a link, NVMe or
   a staging buffer is compute not running), and "step-compute", the step less its
   compute (a difference of two figures ten times its size, so 2-3% of noise on either
   moves it 20-30%). Both are compared with the exposed term the simulator predicts on
   the compute the engine timed inside the step (the in-step prediction, as a run's own
   calibration prices it): an exposed term is a link's seconds less the compute beside
   it, and the compute runs 5-10% slower beside the emulated links' workers than alone.
   The host's work per transfer (the training thread stages each weight load and folds
   each layer's gradients, `StepStats.host_work_s`) is predicted beside it at the rates
   the step ran it ("host", part of the step's compute on this device). Optimizer
   exposure = the step-compute time the optimizer adds (with minus without).

    python bench/fidelity.py [--models demo,large] [--plans auto,megatrain,...] [--rounds 3]
                              [--steps 3]

Compute and the emulation's worker threads share the CPU: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import transformers

from lazytrain_accel.demo.model import DEMO_MODEL_CONFIG
from lazytrain_accel.engine import attach
from lazytrain_accel.engine.device.emulation import EmulationSettings
from lazytrain_accel.engine.stats import Accounting
from lazytrain_accel.engine.step.overlap import LayerwiseUpdate
from lazytrain_accel.engine.step.worker import UpdateWorker
from lazytrain_accel.layer_probe import LayerOverheadProbe, LayerOverheads
from lazytrain_accel.optim import HybridAdamW8bit
from lazytrain_accel.planning import Budgets, build_problem, make_plan, simulate
from lazytrain_accel.planning.problem import GPU_RESERVE_FRACTION
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.planning.simulate import is_optimizer_lane
from lazytrain_accel.profiling.calibration import HOST_WORK_RATES, RATE_FIELDS
from lazytrain_accel.profiling.fingerprint import run_fingerprint
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.measure import measure_host_work
from lazytrain_accel.profiling.model_configs import geometry_from_config, profile_model
from lazytrain_accel.profiling.profile import ModelProfile

GIB = 2**30
NOMINAL_FLOPS_PER_S = 1e12  # measured seconds x this = the profile's FLOPs
H2D_FORWARDS = 1.3  # a layer's weights take 1.3 layer forwards: partly exposed in forward
D2H_BACKWARDS = 0.6  # a layer's gradients take 0.6 of its backward window
NVME_FORWARDS = 1.5  # one boundary file write or read takes 1.5 layer forwards

MODELS: dict[str, tuple[dict, int, int]] = {  # config, batch size, sequence length
    "demo": ({**DEMO_MODEL_CONFIG, "vocab_size": 2048}, 8, 128),
    "large": ({"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
               "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 8192,
               "max_position_embeddings": 512, "tie_word_embeddings": False}, 1, 128),
}


def _model(config: dict) -> transformers.PreTrainedModel:
    cfg = transformers.Qwen2Config(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).train()


class _Case:
    """One engine on the emulated device: a plan, link rates, with or without optimizer."""

    def __init__(self, config: dict, plan, links: dict[str, float], *, with_optimizer: bool,
                 nvme_dir: str) -> None:
        self.model = _model(config)
        self.engine = attach(self.model, plan, device=torch.device("cpu"), nvme_dir=nvme_dir,
                             emulation=EmulationSettings(seed=0, jitter_s=0.0,
                                                         poison_copies=False,
                                                         link_bytes_per_s=links))
        self.optimizer = (HybridAdamW8bit(self.model.parameters(), lr=1e-4)
                          if with_optimizer else None)

    def _step(self, ids: torch.Tensor) -> None:
        self.model(input_ids=ids, labels=ids).loss.backward()
        if self.optimizer is not None:
            self.engine.step_layerwise(self.optimizer)  # runs into the next step's forward
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)

    def steady_steps(self, ids: torch.Tensor, steps: int
                     ) -> tuple[float, float, float, float, dict[str, float]]:
        """Medians over `steps` steps, each following a step (so it waits for that step's
        update), of (seconds, layer compute seconds in it, seconds the previous step's
        update thread ran: the residents' update on the device, if any, runs on the
        training thread beside it, within that span, as the emulated device is async;
        seconds the training thread waited, `stall_s`; the training thread's work per
        transfer: its seconds, and the rates of each kind as the run calibrates them,
        `HOST_WORK_RATES`)."""
        self._step(ids)
        runs, samples = [], []
        for _ in range(steps):
            self.engine.reset_stats()
            start = time.perf_counter()
            self._step(ids)
            elapsed, stats = time.perf_counter() - start, self.engine.stats()
            runs.append((elapsed, stats.compute_s + stats.recompute_s,
                         stats.optimizer_update_s, stats.stall_s,
                         sum(stats.host_work_s.values())))
            samples.append({name: stats.host_work_bytes[kind] / stats.host_work_s[kind]
                            for name, kind in HOST_WORK_RATES.items()
                            if stats.host_work_s[kind] > 0})
        self.engine.synchronize()  # no update left running into another case's step
        host = {"host_s": statistics.median(run[4] for run in runs), **_medians(samples)}
        return (*(statistics.median(run[k] for run in runs) for k in range(4)), host)


class _Calibration:
    """The synchronous engine, every boundary on the device: this CPU's compute; its
    rest of the step leaves out the engine's per-layer-run and per-step overhead
    (`overhead`, that backend's, measured beside it), which the simulator adds."""

    def __init__(self, config: dict, batch: int, seq: int) -> None:
        self.model = _model(config)
        base = profile_model(geometry_from_config(self.model.config.to_dict()),
                             batch_size=batch, seq_len=seq, compute_bytes_per_elem=4)
        plan = make_plan(base, _hardware(1e12, 1e12, 1e12, 1e9),
                         PlanRequest(strategy="checkpoint_all"))
        self.engine = attach(self.model, plan, device=torch.device("cpu"), emulation=False)
        self.layers = base.num_layers

    def measure(self, ids: torch.Tensor, overhead: LayerOverheads | None = None
                ) -> dict[str, float]:
        """Seconds of one layer forward, one layer backward (re-run included), the rest
        (less the layer runs' and the step's `overhead`)."""
        self.engine.reset_stats()
        start = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss
        forward_s = self.engine.stats().compute_s
        loss.backward()
        wall_s, stats = time.perf_counter() - start, self.engine.stats()
        total_s = stats.compute_s
        self.model.zero_grad(set_to_none=True)
        runs_s = 0.0 if overhead is None else overhead.step_s + self.layers * (
            overhead.forward_s + overhead.backward_s)
        # this synchronous engine's weight copies and gradient hand-offs are its links: on
        # the emulated device the links copy and the host stages and folds (`host_s`)
        copies_s = sum(stats.transfer_s.values())
        return {"fwd_s": forward_s / self.layers,
                "bwd_s": (total_s - 2 * forward_s) / self.layers,
                "rest_s": max(wall_s - total_s - runs_s - copies_s, 0.0)}

    def seconds(self, compute: dict[str, float]) -> float:
        """The step's compute seconds in `compute` (forwards, backwards with their re-run,
        the rest)."""
        return self.layers * (2 * compute["fwd_s"] + compute["bwd_s"]) + compute["rest_s"]

    def median(self, ids: torch.Tensor, steps: int, overhead: LayerOverheads | None = None
               ) -> dict[str, float]:
        """The median of `steps` measurements, per term."""
        return _medians([self.measure(ids, overhead) for _ in range(steps)])


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median of `runs`, per term."""
    return {term: statistics.median(run[term] for run in runs) for term in runs[0]}


#: Interleaved probe steps per overhead measurement (their median is taken).
PROBE_REPEATS = 9


def _emulated() -> EmulationSettings:
    """The emulated device the plans run on, links unthrottled (the probe's layers move
    a few bytes)."""
    return EmulationSettings(seed=0, jitter_s=0.0, poison_copies=False)


def measure_compute(config: dict, batch: int, seq: int, steps: int
                    ) -> tuple[dict[str, float], LayerOverheads]:
    """The median of `steps` calibration steps, per term (after one warm-up), and the
    per-layer-run overhead of the emulated backend the plans run on."""
    calibration = _Calibration(config, batch, seq)
    probes = (LayerOverheadProbe(torch.device("cpu")),
              LayerOverheadProbe(torch.device("cpu"), emulation=_emulated()))
    ids = torch.randint(0, config["vocab_size"], (batch, seq))
    calibration.measure(ids)
    sync, emulated = (probe.measure(PROBE_REPEATS) for probe in probes)
    compute = calibration.median(ids, steps, sync)
    calibration.engine.detach()
    for probe in probes:
        probe.close()
    return compute, emulated


def measured_profile(config: dict, batch: int, seq: int, compute: dict[str, float]
                     ) -> ModelProfile:
    base = profile_model(geometry_from_config(_model(config).config.to_dict()),
                         batch_size=batch, seq_len=seq, compute_bytes_per_elem=4)
    F = NOMINAL_FLOPS_PER_S
    return dataclasses.replace(base, layer_fwd_flops=compute["fwd_s"] * F,
                               layer_bwd_flops=compute["bwd_s"] * F,
                               head_fwd_flops=compute["rest_s"] * F / 3.0,  # head_s = 3 x fwd
                               resident_param_bytes=0)


def _hardware(h2d: float, d2h: float, nvme: float, optimizer_params_per_s: float,
              overhead: LayerOverheads | None = None,
              host_rates: tuple[float, float] = (0.0, 0.0)) -> HardwareProfile:
    overhead = overhead or LayerOverheads(forward_s=0.0, backward_s=0.0, step_s=0.0)
    return HardwareProfile(
        name="cpu-emulated", gpu_name="emulated async device", gpu_memory_bytes=64 * GIB,
        cpu_memory_bytes=64 * GIB, nvme_bytes=64 * GIB,
        peak_bf16_flops_per_s=NOMINAL_FLOPS_PER_S, achieved_flops_per_s=NOMINAL_FLOPS_PER_S,
        h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, nvme_read_bytes_per_s=nvme,
        nvme_write_bytes_per_s=nvme, cpu_optimizer_params_per_s=optimizer_params_per_s,
        # the device is this CPU: residents updated "on the device" take the host kernel,
        # on the training thread beside the update thread, as on a GPU: the emulated
        # device is async (the engine's `device_update_beside_host`)
        gpu_optimizer_params_per_s=optimizer_params_per_s, device_runs_async=True,
        # the emulated device computes on the training thread, which stages and folds too;
        # the plans are made at a probe's rates (`measure_host_work`), each round
        # predicted at its steps' own
        compute_on_host=True, host_stage_bytes_per_s=host_rates[0],
        host_fold_bytes_per_s=host_rates[1],
        layer_forward_overhead_s=overhead.forward_s,
        layer_backward_overhead_s=overhead.backward_s, step_overhead_s=overhead.step_s,
        source="bench/fidelity.py: compute measured on this CPU, links chosen against it")


class _UpdateBeside:
    """HybridAdamW8bit's update of a model as a step with the optimizer runs it: the
    engine's update thread (`LayerwiseUpdate`: embeddings, layer 1..L, final norm and
    head, in that order), each group's gradients freed after its update (`zero_grad`
    deferred, as the step's is), beside a calibration step on this thread. On this CPU
    the two share the cores and the memory: the update, timed alone on gradients it keeps,
    ran 1.3-2.5x faster than inside the steps, and the compute beside it runs slower."""

    def __init__(self, config: dict) -> None:
        self.model = _model(config)
        body, seen = self.model.model, set()
        self.groups = [[p for p in params if not (p in seen or seen.add(p))]
                       for params in (list(body.embed_tokens.parameters()),
                                      *(list(layer.parameters()) for layer in body.layers),
                                      [*body.norm.parameters(),
                                       *self.model.lm_head.parameters()])]
        self.params = sum(p.numel() for group in self.groups for p in group)
        self.optimizer = HybridAdamW8bit(self.model.parameters(), lr=1e-4)
        self._gradients()
        self.optimizer.step()  # allocates the 8-bit states
        self.worker = UpdateWorker()

    def _gradients(self) -> None:
        for p in self.model.parameters():
            p.grad = torch.full_like(p, 1e-3)

    def measure(self, beside: Callable[[], dict[str, float]]) -> tuple[float, dict[str, float]]:
        """(params/s of the update, `beside()`'s result), `beside` run on this thread
        while the update runs on its own."""
        self._gradients()
        accounting = Accounting()
        if not self.optimizer.begin_step():
            raise RuntimeError("the calibration update's gradients are not finite")
        update = LayerwiseUpdate(self.optimizer, self.groups, accounting)
        self.worker.submit(update.run)
        update.defer_zero_grad(set_to_none=True)  # as the step's `zero_grad()` is
        try:
            measured = beside()
        finally:
            update.wait()
        return self.params / accounting.snapshot().optimizer_update_s, measured

    def interleaved(self, calibration: _Calibration, ids: torch.Tensor, steps: int,
                    overhead: LayerOverheads | None = None
                    ) -> tuple[dict[str, float], dict[str, float], float]:
        """`steps` calibration steps alone and `steps` beside the update, taking turns (a
        change of load hits both alike): the compute alone (medians per term); the same
        with the seconds the update took from the step's compute (the median of the
        pairs' differences) added to the rest; the update's params/s (median).

        The update runs at the start of the step, in its first forward: its cost is
        charged once per step, not to every layer forward and re-run."""
        alone, added_s, rates = [], [], []
        for _ in range(steps):
            alone.append(calibration.measure(ids, overhead))
            rate, beside = self.measure(functools.partial(calibration.measure, ids, overhead))
            added_s.append(calibration.seconds(beside) - calibration.seconds(alone[-1]))
            rates.append(rate)
        compute = _medians(alone)
        added = max(statistics.median(added_s), 0.0)  # below 0: noise, not a faster step
        return compute, {**compute, "rest_s": compute["rest_s"] + added}, \
            statistics.median(rates)


def optimizer_rate(config: dict, batch: int, seq: int, steps: int) -> float:
    """Params/s of HybridAdamW8bit's update of the whole model on its thread beside a
    calibration step, as a step with the optimizer runs it (the median of `steps`)."""
    calibration, update = _Calibration(config, batch, seq), _UpdateBeside(config)
    ids = torch.randint(0, config["vocab_size"], (batch, seq))
    calibration.measure(ids)
    rate = statistics.median(update.measure(functools.partial(calibration.measure, ids))[0]
                             for _ in range(steps))
    calibration.engine.detach()
    return rate


def link_hardware(profile: ModelProfile, compute: dict[str, float],
                  optimizer_params_per_s: float, overhead: LayerOverheads | None = None,
                  host_rates: tuple[float, float] = (0.0, 0.0)) -> HardwareProfile:
    """The emulated device's profile: links chosen against `compute`, the host's work per
    transfer at `host_rates` (stage, fold bytes/s; 0: not priced)."""
    fwd_s, bwd_s = compute["fwd_s"], compute["bwd_s"]
    return _hardware(h2d=profile.layer_param_bytes / (H2D_FORWARDS * fwd_s),
                     d2h=profile.layer_grad_bytes / (D2H_BACKWARDS * (fwd_s + bwd_s)),
                     nvme=profile.boundary_bytes / (NVME_FORWARDS * fwd_s),
                     optimizer_params_per_s=optimizer_params_per_s, overhead=overhead,
                     host_rates=host_rates)


def plans(profile: ModelProfile, hw: HardwareProfile) -> dict[str, object]:
    out = {name: make_plan(profile, hw, PlanRequest(strategy=strategy, time_limit_s=20.0))
           for name, strategy in (("auto", "lazytrain"), ("megatrain", "megatrain"),
                                  ("offload_all", "offload_all"))}
    # No recompute, room for three boundaries on the device and two on the host: the
    # rest must go to NVMe.
    p = build_problem(profile, hw, max_recompute_block=1)
    A = profile.boundary_bytes
    gpu = int((p.static_gpu_bytes + (p.staging_boundaries + 3) * A)
              / (1 - GPU_RESERVE_FRACTION)) + 1
    budgets = Budgets(gpu_bytes=gpu, cpu_bytes=p.cpu_fixed_bytes + 2 * A, nvme_bytes=64 * GIB)
    out["auto+nvme"] = make_plan(profile, hw, PlanRequest(strategy="lazytrain", budgets=budgets,
                                                          max_recompute_block=1, time_limit_s=20.0))
    return out


def run_plan(config: dict, plan, hw: HardwareProfile, batch: int, seq: int, rounds: int,
             steps: int, tmp: str) -> list[dict]:
    """Per round (medians of `steps` each): this CPU's compute, alone and beside the
    update (`_UpdateBeside.interleaved`: the update's rate and what it takes from the
    step's compute), then the steady step on throttled links without and with the
    optimizer, each with the layer compute timed inside it; the engines take turns, so
    load changes hit them alike."""
    rates = {"h2d": hw.h2d_bytes_per_s, "d2h": hw.d2h_bytes_per_s,
             "nvme_read": hw.nvme_read_bytes_per_s, "nvme_write": hw.nvme_write_bytes_per_s}
    ids = torch.randint(0, config["vocab_size"], (batch, seq))
    calibration, update = _Calibration(config, batch, seq), _UpdateBeside(config)
    probes = (LayerOverheadProbe(torch.device("cpu")),
              LayerOverheadProbe(torch.device("cpu"), emulation=_emulated()))
    runs = 2 * plan.num_layers + plan.recomputed_layer_runs
    cases = {"step": _Case(config, plan, rates, with_optimizer=False, nvme_dir=tmp),
             "step_opt": _Case(config, plan, rates, with_optimizer=True, nvme_dir=tmp)}
    out = []
    for _ in range(rounds + 1):  # the first round warms up
        calibration.measure(ids)
        sync, emulated = (probe.measure(PROBE_REPEATS) for probe in probes)
        row: dict = {"overhead": emulated}
        row["compute"], row["compute_opt"], row["optimizer_rate"] = update.interleaved(
            calibration, ids, steps, sync)
        forward_runs = runs - plan.num_layers
        runs_s = (forward_runs * emulated.forward_s + plan.num_layers * emulated.backward_s
                  + emulated.step_s)
        for name, case in cases.items():
            (row[name], row[f"{name}_layers"], row[f"{name}_update"],
             row[f"{name}_waited"], row[f"{name}_host"]) = case.steady_steps(ids, steps)
            # the step's compute: its layers as timed in it, the rest as calibrated, the
            # layer runs' overhead as measured on the emulated backend, and the host's work
            # per transfer (the compute's thread does it here: its `host_s` is predicted
            # beside the compute's, not in the exposed term)
            row[f"{name}_compute"] = (row[f"{name}_layers"] + row["compute"]["rest_s"] + runs_s
                                      + row[f"{name}_host"]["host_s"])
        out.append(row)
    for engine in [calibration.engine, *(case.engine for case in cases.values())]:
        engine.detach()
    for probe in probes:
        probe.close()
    return out[1:]


def predict(plan, config: dict, batch: int, seq: int, compute: dict[str, float],
            hw: HardwareProfile, *, optimizer_params_per_s: float | None = None,
            overhead: LayerOverheads | None = None, host: dict[str, float] | None = None):
    """`plan`'s simulated step on `compute`'s profile, with the host update at
    `optimizer_params_per_s` (None: without it).

    The plan was made for the first calibration; its decisions are re-simulated on a
    round's compute, so its fingerprint is renewed for that profile (same model, batch
    and links; only the measured seconds differ)."""
    profile = measured_profile(config, batch, seq, compute)
    if overhead is not None:  # the round's, of the emulated backend
        hw = dataclasses.replace(hw, layer_forward_overhead_s=overhead.forward_s,
                                 layer_backward_overhead_s=overhead.backward_s,
                                 step_overhead_s=overhead.step_s)
    if host:  # the host's work per transfer at the rates the step ran them
        hw = dataclasses.replace(hw, **{RATE_FIELDS[name]: rate for name, rate in host.items()
                                        if name in HOST_WORK_RATES})
    if optimizer_params_per_s is not None:
        hw = dataclasses.replace(hw, cpu_optimizer_params_per_s=optimizer_params_per_s,
                                 gpu_optimizer_params_per_s=optimizer_params_per_s)
    plan = dataclasses.replace(plan, fingerprint=run_fingerprint(profile, hw))
    return simulate(plan, profile, hw, include_optimizer=optimizer_params_per_s is not None)


def in_step(plan, compute: dict[str, float], layers_s: float) -> dict[str, float]:
    """`compute` with its layer seconds scaled to those the engine timed inside a step
    (`layers_s`: forwards, backwards and re-runs), i.e. to the CPU's load at that moment;
    the rest of the step as calibrated."""
    L = plan.num_layers
    k = layers_s / ((2 * L + plan.recomputed_layer_runs) * compute["fwd_s"]
                    + L * compute["bwd_s"])
    return {**compute, "fwd_s": compute["fwd_s"] * k, "bwd_s": compute["bwd_s"] * k}


def predictions(plan, config: dict, batch: int, seq: int, meas: dict, hw: HardwareProfile,
                host_params: int) -> dict:
    """A round's predictions: on its calibrated compute (beside the update for the step
    with the optimizer) and update rate, and on the durations timed inside its steps
    (layer compute; the update thread's run time, `host_params` updated on it)."""
    update_s, overhead = meas["step_opt_update"], meas.get("overhead")
    host, host_opt = meas["step_host"], meas["step_opt_host"]
    return {
        "step": predict(plan, config, batch, seq, meas["compute"], hw, overhead=overhead,
                        host=host),
        "opt": predict(plan, config, batch, seq, meas["compute_opt"], hw,
                       optimizer_params_per_s=meas["optimizer_rate"], overhead=overhead,
                       host=host_opt),
        "step_in": predict(plan, config, batch, seq,
                           in_step(plan, meas["compute"], meas["step_layers"]), hw,
                           overhead=overhead, host=host),
        "opt_in": predict(plan, config, batch, seq,
                          in_step(plan, meas["compute_opt"], meas["step_opt_layers"]), hw,
                          optimizer_params_per_s=(host_params / update_s if update_s > 0
                                                  else meas["optimizer_rate"]),
                          overhead=overhead, host=host_opt),
    }


HEADER = (f"{'model':>5} {'plan':>11} {'homes g/c/n/r residents':>24} | {'step pred':>9} "
          f"{'meas':>6} "
          f"{'ratio':>5} | {'compute pred':>12} {'meas':>6} | {'host pred':>9} {'meas':>6} "
          f"| {'exposed pred':>12} "
          f"{'waited':>6} {'ratio':>5} {'step-compute':>12} {'ratio':>5} "
          f"| {'+optim pred':>11} {'meas':>6} {'ratio':>5} | {'opt exposed pred':>16} "
          f"{'meas':>6} | {'update pred':>11} {'meas':>6} | in-step ratios: step +optim")


def _row(model: str, name: str, plan, preds: dict, meas: dict) -> str:
    pred, pred_opt, terms = preds["step"], preds["opt"], preds["step_in"]
    homes = "/".join(str(n) for n in plan.count_homes().values()) + (
        " gpu" if plan.resident_update == "device" else " host")
    # the exposed term measured twice: the seconds the training thread waited (the
    # engine's stall_s: every wait timed where it blocks), and the step less its compute
    # (a difference of two figures ~10x its size: 2-3% noise on either moves it 20-30%).
    # Its prediction and the host's are the simulator's on the compute the engine timed
    # inside the step (`terms`, as a run's calibration prices it): an exposed term is a
    # link's seconds less the compute beside it, so the compute the link workers leave
    # the step (5-10% slower than alone on 2 cores) moves it 2-3x as much.
    waited, exposed = meas["step_waited"], meas["step"] - meas["step_compute"]
    optimizer = meas["step_opt"] - meas["step_opt_compute"] - exposed
    return (f"{model:>5} {name:>11} {homes:>24} | {pred.step_s:9.3f} {meas['step']:6.3f} "
            f"{meas['step'] / pred.step_s:5.2f} | {pred.step_s - pred.exposed_s:12.3f} "
            f"{meas['step_compute']:6.3f} | {terms.host_s:9.3f} {meas['step_host']['host_s']:6.3f} "
            f"| {terms.exposed_s:12.3f} {waited:6.3f} "
            f"{exposed_ratio(waited, terms.exposed_s)} {exposed:12.3f} "
            f"{exposed_ratio(exposed, terms.exposed_s)} "
            f"| {pred_opt.step_s:11.3f} {meas['step_opt']:6.3f} "
            f"{meas['step_opt'] / pred_opt.step_s:5.2f} | {pred_opt.optimizer_exposed_s:16.3f} "
            f"{optimizer:6.3f} | {_update_s(pred_opt):11.3f} {meas['step_opt_update']:6.3f} "
            f"| {meas['step'] / preds['step_in'].step_s:19.2f} "
            f"{meas['step_opt'] / preds['opt_in'].step_s:6.2f}")


def exposed_ratio(measured_s: float, predicted_s: float) -> str:
    """The exposed term's measured / predicted, as the step's ratio beside it (issue 34:
    a step ratio near 1 hid an exposed term 1.2-1.75x its prediction); "-" where nothing
    was predicted exposed."""
    return f"{measured_s / predicted_s:5.2f}" if predicted_s > 0 else f"{'-':>5}"


def _update_s(result) -> float:
    """Seconds of the simulated update: from its first op to its last on the host and
    device optimizer lanes (they run side by side), as its thread spans it."""
    ops = [op for op in result.ops if is_optimizer_lane(op.resource)]
    return max(op.end_s for op in ops) - min(op.start_s for op in ops)


def report_plan(name: str, plan_name: str, plan, config: dict, batch: int, seq: int,
                hw: HardwareProfile, rounds: int, steps: int) -> str:
    """The row of the round with the median step ratio, and the ratios' spread."""
    with tempfile.TemporaryDirectory() as tmp:
        measured = run_plan(config, plan, hw, batch, seq, rounds, steps, tmp)
    profile = measured_profile(config, batch, seq, measured[0]["compute"])
    host_params = profile.trainable_param_count - (
        profile.resident_trainable_param_count if plan.resident_update == "device" else 0)
    rows = []
    for meas in measured:
        preds = predictions(plan, config, batch, seq, meas, hw, host_params)
        rows.append((meas["step"] / preds["step"].step_s, preds, meas))
    rows.sort(key=lambda r: r[0])
    _, preds, meas = rows[len(rows) // 2]
    optim = sorted(r[2]["step_opt"] / r[1]["opt"].step_s for r in rows)
    return (_row(name, plan_name, plan, preds, meas)
            + f"  (rounds: step {rows[0][0]:.2f}-{rows[-1][0]:.2f}, +optim "
              f"{optim[0]:.2f}-{optim[-1]:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,large")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3,
                        help="steps per measurement in a round (their median is taken)")
    parser.add_argument("--plans", default="auto,megatrain,offload_all,auto+nvme")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core computes; the emulated links and updates use another
    print(HEADER)
    for name in args.models.split(","):
        config, batch, seq = MODELS[name]
        compute, overhead = measure_compute(config, batch, seq, args.steps)
        profile = measured_profile(config, batch, seq, compute)
        hw = link_hardware(profile, compute, optimizer_rate(config, batch, seq, args.steps),
                           overhead, measure_host_work(torch.device("cpu")))
        print(f"# {name}: {profile.geometry.total_param_count / 1e6:.0f}M parameters, "
              f"{profile.num_layers} layers, batch {batch} x {seq}; measured layer fwd "
              f"{compute['fwd_s'] * 1e3:.1f} ms, bwd {compute['bwd_s'] * 1e3:.1f} ms, rest "
              f"{compute['rest_s'] * 1e3:.0f} ms, layer run overhead "
              f"{overhead.forward_s * 1e3:.1f} / {overhead.backward_s * 1e3:.1f} ms, step "
              f"{overhead.step_s * 1e3:.0f} ms; links H2D "
              f"{hw.h2d_bytes_per_s / 1e6:.0f}, "
              f"D2H {hw.d2h_bytes_per_s / 1e6:.0f}, NVMe {hw.nvme_read_bytes_per_s / 1e6:.1f} "
              f"MB/s; optimizer {hw.cpu_optimizer_params_per_s / 1e6:.0f}M params/s; host "
              f"stage {hw.host_stage_bytes_per_s / 1e9:.1f}, fold "
              f"{hw.host_fold_bytes_per_s / 1e9:.1f} GB/s (the plans'; each round is "
              f"predicted at its steps' own)", flush=True)
        for plan_name, plan in plans(profile, hw).items():
            if plan_name not in args.plans.split(","):
                continue
            print(report_plan(name, plan_name, plan, config, batch, seq, hw, args.rounds,
                              args.steps), flush=True)


if __name__ == "__main__":
    main()
