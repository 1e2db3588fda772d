"""`lazytrain profile`: a model's per-layer bytes, FLOPs and seconds on a hardware profile."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lazytrain_accel.cli import CliError, help_of
from lazytrain_accel.cli.args import add_lora_args, add_loss_chunk_arg, positive_int
from lazytrain_accel.cli.lora import lora_weights
from lazytrain_accel.config import env_setting
from lazytrain_accel.profiling.calibration import calibration_note
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS, HardwareProfile
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.profiling.model_configs import (
    COMPUTE_DTYPE_BYTES,
    MODEL_PRESETS,
    geometry_from_config,
    load_model_config,
    model_preset_source,
    profile_model,
)
from lazytrain_accel.profiling.profile import ModelProfile

_GIB = 1024**3


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    p = subparsers.add_parser(
        name, help=help_of(name),
        description="Analytic profile of a decoder-only model at one micro-batch shape, "
        "with per-layer compute and transfer seconds on a hardware profile.")
    p.add_argument("--model", help=f"preset ({', '.join(MODEL_PRESETS)}), HF model "
                   "directory or config .json")
    p.add_argument("--hardware", help="preset (" + ", ".join(HARDWARE_PRESETS)
                   + "), hardware JSON, or 'auto' to measure this machine (default: "
                   "LAZYTRAIN_HARDWARE, else auto)")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="micro-batch size (default 1)")
    p.add_argument("--seq-len", type=positive_int, default=1024,
                   help="sequence length (default 1024)")
    p.add_argument("--dtype", choices=sorted(COMPUTE_DTYPE_BYTES), default="bf16",
                   help="compute dtype of activations and streamed weights (default bf16)")
    add_loss_chunk_arg(p)
    add_lora_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--save-hardware", metavar="PATH",
                   help="also write the hardware profile as JSON to PATH")
    p.add_argument("--refresh", action="store_true",
                   help="with --hardware auto: measure again instead of reading the cache")
    p.add_argument("--list-models", action="store_true", help="list model presets and exit")
    p.add_argument("--list-hardware", action="store_true",
                   help="list hardware presets and exit")


def layer_seconds(model: ModelProfile, hardware: HardwareProfile) -> dict[str, float]:
    """Per-layer seconds of compute and of each transfer a layer can cost, as the planner
    prices them (`Problem`: a QLoRA layer's compute includes its dequantization)."""
    from lazytrain_accel.planning.problem import build_problem

    p = build_problem(model, hardware)
    return {
        "layer_fwd_s": p.fwd_s,
        "layer_bwd_s": p.bwd_s,
        "head_fwd_bwd_s": p.head_s,
        "layer_weights_h2d_s": p.layer_param_bytes / p.rate_bytes_per_s("h2d"),
        "layer_grads_d2h_s": p.layer_grad_bytes / p.rate_bytes_per_s("d2h"),
        **{f"boundary_{link}_s": p.boundary_bytes / p.rate_bytes_per_s(link)
           for link in ("d2h", "h2d", "nvme_write", "nvme_read")},
    }


def _model_rows(model: ModelProfile) -> list[tuple[str, str]]:
    g = model.geometry
    return [
        ("model", f"{g.name} ({g.family})"),
        ("layers", str(g.num_layers)),
        ("parameters", f"{g.total_param_count / 1e9:.3f} B"),
        ("hidden / intermediate", f"{g.hidden_size} / {g.intermediate_size}"),
        ("heads / kv heads / head dim", f"{g.num_attention_heads} / {g.num_kv_heads} / "
                                        f"{g.head_dim}"),
        ("batch x seq", f"{model.batch_size} x {model.seq_len} "
                        f"({model.compute_bytes_per_elem} bytes/elem)"),
        ("boundary bytes (A)", f"{model.boundary_bytes / _GIB:.3f} GiB"),
        ("all L+1 boundaries", f"{(g.num_layers + 1) * model.boundary_bytes / _GIB:.2f} GiB"),
        ("layer params", f"{g.layer_param_count / 1e6:.1f} M "
                         f"({model.layer_param_bytes / _GIB:.3f} GiB)"),
        ("layer backward working set", f"{model.layer_working_bytes / _GIB:.3f} GiB"),
        ("head + loss working set", f"{model.head_working_bytes / _GIB:.3f} GiB"),
        ("resident params (emb/norm/head)", f"{model.resident_param_bytes / _GIB:.3f} GiB"),
        ("layer forward / backward", f"{model.layer_fwd_flops / 1e12:.2f} / "
                                     f"{model.layer_bwd_flops / 1e12:.2f} TFLOP"),
        *_split_rows(model),
    ]


def _split_rows(model: ModelProfile) -> list[tuple[str, str]]:
    """Trainable vs frozen rows of a LoRA / QLoRA profile (none for a full fine-tune)."""
    w = model.weights
    if w is None:
        return []
    return [
        ("layer trainable / frozen params", f"{w.layer_trainable_param_count / 1e6:.2f} M / "
                                            f"{w.layer_frozen_param_count / 1e6:.1f} M"),
        ("layer frozen stored", f"{w.layer_frozen_host_bytes / _GIB:.3f} GiB {w.frozen_format}"
                                f" (scales {w.layer_frozen_scale_bytes / 2**20:.2f} MiB)"),
        ("trainable params (all)", f"{model.trainable_param_count / 1e6:.1f} M"),
        ("frozen weights on the host", f"{model.frozen_host_bytes / _GIB:.2f} GiB"),
    ]


def _hardware_rows(hw: HardwareProfile, seconds: dict[str, float]) -> list[tuple[str, str]]:
    ms = {k: f"{v * 1e3:.2f} ms" for k, v in seconds.items()}
    note = calibration_note(hw)  # a run's measured rates, kept for hardware="auto"
    return [
        ("hardware", f"{hw.name} ({hw.gpu_name})"),
        *([("calibrated", note)] if note else []),
        ("GPU / host / NVMe", f"{hw.gpu_memory_bytes / _GIB:.1f} / "
                              f"{hw.cpu_memory_bytes / _GIB:.0f} / {hw.nvme_bytes / 1e12:.2f} TB"
                              " (GiB, GiB, TB)"),
        ("achieved / peak", f"{hw.achieved_flops_per_s / 1e12:.3g} / "
                            f"{hw.peak_bf16_flops_per_s / 1e12:.3g} TFLOPS"),
        ("H2D / D2H", f"{hw.h2d_bytes_per_s / 1e9:.2f} / {hw.d2h_bytes_per_s / 1e9:.2f} GB/s"),
        ("NVMe read / write", f"{hw.nvme_read_bytes_per_s / 1e9:.2f} / "
                              f"{hw.nvme_write_bytes_per_s / 1e9:.2f} GB/s"),
        ("layer forward / backward", f"{ms['layer_fwd_s']} / {ms['layer_bwd_s']}"),
        ("layer weights H2D / grads D2H", f"{ms['layer_weights_h2d_s']} / "
                                          f"{ms['layer_grads_d2h_s']}"),
        ("boundary D2H / H2D", f"{ms['boundary_d2h_s']} / {ms['boundary_h2d_s']}"),
        ("boundary NVMe write / read", f"{ms['boundary_nvme_write_s']} / "
                                       f"{ms['boundary_nvme_read_s']}"),
    ]


def _print_tables(sections: list[tuple[str, list[tuple[str, str]]]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for title, rows in sections:
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for key, value in rows:
            table.add_row(key, value)
        console.print(table)


def _list_presets(args: argparse.Namespace) -> None:
    if args.list_models:
        for name in MODEL_PRESETS:
            print(f"{name:14s} {model_preset_source(name)}")
    if args.list_hardware:
        for name, hw in HARDWARE_PRESETS.items():
            print(f"{name:10s} {hw.gpu_name}: {hw.source}")


def run(args: argparse.Namespace) -> int:
    if args.list_models or args.list_hardware:
        _list_presets(args)
        return 0
    if not args.model:
        raise CliError("--model is required (a preset, a HF model directory or a config "
                       "JSON); see `lazytrain profile --list-models`", exit_code=2)
    try:
        geometry, weights = lora_weights(
            geometry_from_config(load_model_config(args.model), name=args.model), args)
        model = profile_model(geometry, batch_size=args.batch_size, seq_len=args.seq_len,
                              compute_bytes_per_elem=COMPUTE_DTYPE_BYTES[args.dtype],
                              loss_chunk_tokens=args.loss_chunk_tokens, weights=weights)
        hardware = load_hardware(args.hardware or env_setting("hardware"), refresh=args.refresh,
                                 cache_dir=env_setting("cache_dir"),
                                 nvme_dir=env_setting("nvme_dir"))
    except ValueError as err:
        raise CliError(str(err), exit_code=2) from None
    if args.save_hardware:
        hardware.save(args.save_hardware)
    seconds = layer_seconds(model, hardware)
    if args.json:
        out: dict[str, Any] = {"model": model.to_dict(), "hardware": hardware.to_dict(),
                               "seconds": seconds}
        out["model"]["total_param_count"] = geometry.total_param_count
        print(json.dumps(out, indent=1))
    else:
        _print_tables([("Model profile", _model_rows(model)),
                       ("On hardware", _hardware_rows(hardware, seconds))])
    return 0
