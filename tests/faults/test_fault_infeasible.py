"""Infeasible budgets: refused before any allocation, naming each binding tier, its need,
its budget and the largest batch that does fit; the CLI exits 2 with that paragraph."""

from __future__ import annotations

import pytest
import torch
from fault_helpers import BATCH, SEQ, loader, tiny_model

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.cli import main
from lazytrain_accel.planning import Budgets, PlanInfeasibleError, make_plan, max_batch_size
from lazytrain_accel.planning.infeasible import BatchInfeasibleError
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware_spec import load_hardware
from lazytrain_accel.run import setup

# The model's own loss (full logits): "auto" would turn the fused loss on and fit.
RUN = ["--model", "qwen2.5-3b", "--hardware", "h800", "--seq-len", "1024",
       "--strategy", "checkpoint_all", "--loss-chunk-tokens", "0"]


def test_cli_names_the_tier_its_budget_and_the_largest_batch(capsys) -> None:
    assert main(["plan", *RUN, "--batch-size", "64", "--gpu-memory-gb", "24"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lazytrain plan: no checkpoint_all plan fits")
    assert "GPU short by" in err and "budget 24.00 GiB" in err and "needs " in err
    assert "Traceback" not in err and err.count("\n") == 1  # one paragraph
    largest = int(err.split("at seq 1024 is ")[1].split(" ")[0])
    # the figure is admission's own answer, and it really plans
    assert main(["max-batch", *RUN, "--gpu-memory-gb", "24", "--json"]) == 0
    assert f'"max_batch_size": {largest}' in capsys.readouterr().out
    assert main(["plan", *RUN, "--batch-size", str(largest), "--gpu-memory-gb", "24"]) == 0
    assert main(["plan", *RUN, "--batch-size", str(largest + 1), "--gpu-memory-gb", "24"]) == 2


def test_cli_says_when_not_even_batch_one_fits(capsys) -> None:
    assert main(["plan", *RUN, "--batch-size", "4", "--gpu-memory-gb", "1"]) == 2
    err = capsys.readouterr().err
    assert "Not even micro-batch 1 plans at seq 1024" in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "words"), [
    (["plan", "--model", "gpt-9", "--hardware", "h800", "--seq-len", "8", "--batch-size", "1"],
     "'gpt-9' is neither a preset"),
    (["plan", "--model", "tiny-demo", "--hardware", "tpu9", "--seq-len", "8",
      "--batch-size", "1"], "hardware 'tpu9' is not valid"),
    (["max-batch", "--model", "tiny-demo", "--hardware", "h800", "--seq-len", "8",
      "--gpu-memory-gb", "-1"], "negative"),
])
def test_cli_input_errors_exit_2_in_one_paragraph(argv, words, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_prepare_refuses_before_attaching_with_the_largest_batch(tmp_path) -> None:
    model = tiny_model()
    hardware = load_hardware("h800")
    profile = setup.profile_for_run(model, batch_size=BATCH, seq_len=SEQ, compute_dtype=None)
    # The smallest GPU budget batch 2 plans in (bisected on the planner itself): batch 4
    # cannot fit in it, and the largest batch that does is 2 or 3.
    fits_bytes, short_bytes = 2**30, 1
    while fits_bytes - short_bytes > 1024:
        mid = (fits_bytes + short_bytes) // 2
        try:
            make_plan(setup.profile_for_run(model, batch_size=2, seq_len=SEQ,
                                            compute_dtype=None), hardware,
                      PlanRequest(strategy="checkpoint_all", budgets=Budgets.from_hardware(
                                  hardware, gpu_memory_limit_gb=mid / 2**30)))
            fits_bytes = mid
        except PlanInfeasibleError:
            short_bytes = mid
    budget_gb = fits_bytes / 2**30
    plugin = LazyTrainPlugin(plan="checkpoint_all", hardware="h800", gpu_memory_limit_gb=budget_gb,
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    acc = Accelerator(cpu=True, plugin=plugin)
    with pytest.raises(BatchInfeasibleError) as info:
        acc.prepare(model, torch.optim.AdamW(model.parameters()), loader())
    expected = max_batch_size(
        lambda b: setup.profile_for_run(model, batch_size=b, seq_len=SEQ, compute_dtype=None),
        hardware, PlanRequest(strategy="checkpoint_all", budgets=Budgets.from_hardware(
            hardware, gpu_memory_limit_gb=budget_gb)))
    assert info.value.largest_batch_size == expected and expected in (2, 3)
    assert set(info.value.shortfall_bytes) == {"gpu"} and profile.batch_size == BATCH
    assert f"is {expected} (asked: {BATCH})" in str(info.value)
    assert acc.lazytrain is None  # nothing attached
    assert all("forward" not in vars(layer) for layer in model.model.layers)
