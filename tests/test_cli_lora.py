"""`lazytrain plan` for LoRA and QLoRA (issue 17): llama3-70b QLoRA plans on an RTX 4090
with a 64 GB host at 4 x 1024 tokens; with a bf16 base the refusal names the host tier,
its largest term (the frozen weights) and what shrinks it."""

from __future__ import annotations

import json

import pytest

from lazytrain_accel.cli import main

RUN = ["--model", "llama3-70b", "--hardware", "rtx4090", "--cpu-memory-gb", "64",
       "--lora-rank", "16", "--batch-size", "4", "--seq-len", "1024", "--time-limit-s", "20"]


def test_qlora_70b_plans_on_a_4090_with_64_gb(capsys) -> None:
    assert main(["plan", *RUN, "--frozen-format", "nf4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lazytrain: batch 4 x seq 1024, step ")
    assert "peaks: GPU" in out


def test_lora_70b_on_a_bf16_base_says_why_it_does_not_fit(capsys) -> None:
    assert main(["plan", *RUN, "--frozen-format", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "CPU short by" in err and "budget 64.00 GiB" in err
    assert "the frozen weights as stored (bf16)" in err and "--frozen-format nf4" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_full_fine_tune_refusal_points_at_lora(capsys) -> None:
    # a drive too small for the state (with room there, the state goes to NVMe and the
    # full fine-tune plans: tests/planning/test_state_homes.py)
    run = [a for a in RUN if a not in ("--lora-rank", "16")] + ["--nvme-gb", "1"]
    assert main(["plan", *run]) == 2
    err = capsys.readouterr().err
    assert "the trainable parameters' fp32 masters" in err and "--lora-rank" in err


def _peak_cpu_gib(capsys, *flags: str) -> float:
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h800", "--batch-size", "1",
                 "--seq-len", "1024", "--time-limit-s", "10", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["peak_cpu_bytes"] / 2**30


def test_host_bytes_shrink_from_full_to_lora_to_qlora(capsys) -> None:
    full = _peak_cpu_gib(capsys)
    lora = _peak_cpu_gib(capsys, "--lora-rank", "16")
    qlora = _peak_cpu_gib(capsys, "--lora-rank", "16", "--frozen-format", "nf4")
    # 8B: full ~10 B/param + bf16 compute copies of the layers (79.8 GiB); LoRA a 2 B/param
    # bf16 base + its layers' bf16 compute copies (the overlapped update writes one per
    # layer, frozen weights included) + adapters (29.3); QLoRA 0.56 B per linear weight +
    # bf16 embeddings and head, packed weights have no compute copy (6.3)
    assert full > 2.5 * lora and lora > 4 * qlora


@pytest.mark.parametrize("flags, says", [
    (["--frozen-format", "nf4"], "add --lora-rank R"),
    (["--lora-rank", "8", "--lora-targets", "c_attn"], "are not linears of a llama layer"),
    (["--lora-rank", "8", "--frozen-format", "int3"], "invalid choice"),
])
def test_lora_flag_errors_exit_2(capsys, flags: list[str], says: str) -> None:
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h800", "--batch-size", "1",
                 "--seq-len", "128", *flags]) == 2
    assert says in capsys.readouterr().err


def test_adapter_config_file_gives_rank_and_targets(capsys, tmp_path) -> None:
    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps({"r": 16, "target_modules": ["q_proj", "v_proj"],
                                  "peft_type": "LORA"}))
    base = ["plan", "--model", "llama3-8b", "--hardware", "h800", "--batch-size", "1",
            "--seq-len", "128", "--time-limit-s", "10", "--json"]
    assert main([*base, "--adapter-config", str(config)]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main([*base, "--lora-rank", "16", "--lora-targets", "q_proj", "v_proj"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_cpu_bytes"] == from_file["peak_cpu_bytes"]


def test_profile_shows_trainable_and_frozen(capsys) -> None:
    assert main(["profile", "--model", "llama3-70b", "--hardware", "rtx4090", "--lora-rank",
                 "16", "--frozen-format", "nf4", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    weights = model["weights"]
    assert weights["frozen_format"] == "nf4" and weights["layer_frozen_scale_bytes"] > 0
    assert weights["layer_trainable_param_count"] < weights["layer_frozen_param_count"] / 100
    assert model["layer_grad_bytes"] == 2 * weights["layer_trainable_param_count"]


def test_qlora_70b_admits_at_least_4_x_1024_on_a_4090_and_simulates(capsys) -> None:
    run = [a for a in RUN if a not in ("--batch-size", "4")]
    assert main(["max-batch", *run, "--frozen-format", "nf4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_batch_size"] >= 4  # the goal
    assert main(["simulate", *RUN, "--frozen-format", "nf4", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["step_s"] == pytest.approx(simulated["predicted_step_s"])
    assert simulated["peak_cpu_bytes"] < 64 * 2**30
