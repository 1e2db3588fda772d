"""What one process measures and decides for the whole launch.

Global rank 0 reads or measures the hardware profile, times the model's own layers and
solves the plan; every rank receives them (`ranks.from_first`) before it builds
anything, so the ranks of a launch cannot measure two machines a moment apart and stream
two plans. What differs per rank (its device, its memory) is gathered, and the plan is
made for the least of each budget.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from lazytrain_accel.config import LazyTrainConfig, OptimizerChoice
from lazytrain_accel.distributed import ranks
from lazytrain_accel.planning import Budgets
from lazytrain_accel.profiling.hardware import HardwareProfile
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.profiling.profile import ModelProfile
from lazytrain_accel.profiling.workload import (
    WorkloadRates,
    load_workload,
    save_workload,
    with_workload,
    workload_key,
)
from lazytrain_accel.run import setup

logger = logging.getLogger("lazytrain_accel")

_GIB = 2**30


def shared_hardware(config: LazyTrainConfig, *, device: torch.device,
                    is_main_process: bool) -> tuple[HardwareProfile, Budgets]:
    """The launch's hardware profile (rank 0's: measured once, cached once) and the
    budgets every rank plans with: per tier, the least any rank has."""
    hardware = ranks.from_first(lambda: setup.hardware_for_backend(config, load_hardware(
        config.hardware, cache_dir=config.cache_dir, nvme_dir=config.nvme_dir)))
    if not ranks.is_multi_process():
        return hardware, setup.budgets_for(config, hardware)
    own = hardware
    if config.hardware == "auto":  # this rank's own device and host, not rank 0's
        from lazytrain_accel.profiling.measure import local_capacities

        own = dataclasses.replace(hardware, **local_capacities(device))
    every = ranks.gathered(setup.budgets_for(config, own))
    least = Budgets(gpu_bytes=min(b.gpu_bytes for b in every),
                    cpu_bytes=min(b.cpu_bytes for b in every),
                    nvme_bytes=min(b.nvme_bytes for b in every))
    if is_main_process and any(b != least for b in every):
        logger.info("lazytrain: the ranks' budgets differ (%s); every rank plans for the "
                    "least: device %.2f GiB, host %.2f GiB, NVMe %.2f GiB",
                    _differences(every), least.gpu_bytes / _GIB, least.cpu_bytes / _GIB,
                    least.nvme_bytes / _GIB)
    return hardware, least


def _differences(every: list[Budgets]) -> str:
    """Each tier whose budget differs between ranks, with every rank's figure in GiB."""
    parts = []
    for tier, name in (("gpu_bytes", "device"), ("cpu_bytes", "host"), ("nvme_bytes", "NVMe")):
        values = [getattr(b, tier) for b in every]
        if len(set(values)) > 1:
            parts.append(f"{name}: " + ", ".join(f"rank {r} {v / _GIB:.2f} GiB"
                                                  for r, v in enumerate(values)))
    return "; ".join(parts)


def workload_priced(config: LazyTrainConfig, model: nn.Module, profile: ModelProfile,
                    hardware: HardwareProfile, *, device: torch.device,
                    compute_dtype: torch.dtype | None, may_time: bool) -> HardwareProfile:
    """`hardware` with this workload's compute rate: cached under its workload key, else,
    where `may_time` (at prepare, before the engine is attached), the model's own first
    layer and head timed at `profile`'s batch shape (`layer_timing.py`). A preset or a
    hardware file keeps its own rate; so does a profile where neither is at hand."""
    if config.hardware != "auto":
        return hardware
    key = workload_key(profile, device_name=hardware.gpu_name, threads=torch.get_num_threads())
    rates = load_workload(config.cache_dir, key)
    if rates is None and may_time:
        rates = _time_workload(model, profile, hardware, device=device,
                               compute_dtype=compute_dtype,
                               hybrid=config.optimizer == OptimizerChoice.HYBRID8BIT)
        if rates is not None:
            save_workload(config.cache_dir, key, rates)
    return hardware if rates is None else with_workload(hardware, rates)


#: The most tokens the layer timing runs a layer on at once: a longer batch (a sequence
#: the engine runs in tiles) is timed as one sequence of this many tokens, so the probe
#: never needs the untiled working set the plan avoids.
MAX_TIMED_TOKENS = 16384


def _time_workload(model: nn.Module, profile: ModelProfile, hardware: HardwareProfile, *,
                   device: torch.device, compute_dtype: torch.dtype | None, hybrid: bool
                   ) -> WorkloadRates | None:
    """The compute rate of the model's own first layer and head and, under the hybrid
    operator, the host update's rate on that layer's group; None where the layer cannot
    be called alone."""
    from lazytrain_accel.engine.model.discovery import find_decoder_layers
    from lazytrain_accel.profiling.layer_timing import time_layer_update, time_model_compute
    from lazytrain_accel.profiling.model_configs import profile_model

    if profile.tokens_per_step > MAX_TIMED_TOKENS:
        profile = profile_model(profile.geometry, batch_size=1,
                                seq_len=min(profile.seq_len, MAX_TIMED_TOKENS),
                                compute_bytes_per_elem=profile.compute_bytes_per_elem,
                                weights=profile.weights)
    try:
        timing = time_model_compute(model, find_decoder_layers(model)[2],
                                    batch_size=profile.batch_size, seq_len=profile.seq_len,
                                    device=device, compute_dtype=compute_dtype)
    except Exception as err:  # a layer the probe cannot call must not stop the run
        logger.warning("lazytrain: could not time the model's own layers (%s: %s); pricing "
                       "compute at the square matmul's %.3g TFLOP/s", type(err).__name__,
                       err, hardware.achieved_flops_per_s / 1e12)
        return None
    rate = timing.flops_per_s(profile)
    logger.info("lazytrain: the model's layers run at %.3g TFLOP/s at %d x %d (the square "
                "matmul's roofline: %.3g)", rate / 1e12, profile.batch_size, profile.seq_len,
                hardware.achieved_flops_per_s / 1e12)
    rates = {"achieved_flops_per_s": rate}
    source = (f"the model's own layer and head timed at {profile.batch_size} x "
              f"{profile.seq_len} ({compute_dtype or torch.float32}): layer forward "
              f"{timing.layer_forward_s * 1e3:.3g} ms, backward run "
              f"{timing.layer_backward_s * 1e3:.3g} ms, head {timing.head_s * 1e3:.3g} ms")
    if profile.layer_param_bytes > 0:
        rates.update(_layer_copy_rates(find_decoder_layers(model)[2][0], hardware,
                                       compute_dtype=compute_dtype))
        source += _copy_source(rates, hardware)
    if hybrid and profile.layer_trainable_param_count > 0:
        try:
            update = time_layer_update(find_decoder_layers(model)[2][0],
                                       compute_dtype=compute_dtype, on_gpu=device.type == "cuda")
        except Exception as err:  # as the layer's: never a reason to stop the run
            logger.warning("lazytrain: could not time the update of the model's own layer "
                           "(%s: %s); pricing it at the probe's %.3gM params/s",
                           type(err).__name__, err, hardware.cpu_optimizer_params_per_s / 1e6)
        else:
            rates["cpu_optimizer_params_per_s"] = update
            source += (f"; its update {update / 1e6:.3g}M params/s (the 10M-parameter "
                       f"probe's {hardware.cpu_optimizer_params_per_s / 1e6:.3g}M)")
    return WorkloadRates(rates=rates, source=source)


#: Where a layer's copies are priced: a synchronous device (a CPU) copies on the training
#: thread at the link's rate (`planning/problem.py`), an async one stages and folds there.
_COPY_FIELDS = {False: ("h2d_bytes_per_s", "d2h_bytes_per_s"),
                True: ("host_stage_bytes_per_s", "host_fold_bytes_per_s")}


def _layer_copy_rates(layer: nn.Module, hardware: HardwareProfile, *,
                      compute_dtype: torch.dtype | None) -> dict[str, float]:
    """The rates of the model's own layer's copies (`layer_timing.time_layer_copies`) in
    the fields that price them on `hardware`'s kind of device; none where they cannot be
    timed."""
    from lazytrain_accel.profiling.layer_timing import time_layer_copies

    try:
        timing = time_layer_copies(layer, compute_dtype=compute_dtype,
                                   device_runs_async=hardware.device_runs_async)
    except Exception as err:  # as the layer's compute: never a reason to stop the run
        logger.warning("lazytrain: could not time the copies of the model's own layer "
                       "(%s: %s); pricing them at the machine probe's rates",
                       type(err).__name__, err)
        return {}
    stage, fold = _COPY_FIELDS[hardware.device_runs_async]
    rates = {stage: timing.stage_bytes_per_s}
    if timing.fold_bytes_per_s is not None:
        rates[fold] = timing.fold_bytes_per_s
    return rates


def _copy_source(rates: dict[str, float], hardware: HardwareProfile) -> str:
    """How `_layer_copy_rates`' figures read in a profile's source, beside the probe's."""
    said = [f"{what} at {rates[name] / 1e9:.3g} GB/s (the machine probe's "
            f"{getattr(hardware, name) / 1e9:.3g})"
            for what, name in zip(("weights copied in", "gradients handed back"),
                                  _COPY_FIELDS[hardware.device_runs_async], strict=True)
            if name in rates]
    return f"; its {' and '.join(said)}, tensor by tensor" if said else ""
