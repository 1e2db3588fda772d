"""Arguments, refusals, instance patching and the launcher's import hook (fast, in process
except the import-hook check, which needs a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser, Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

from lazytrain_accel.config import OptimizerChoice
from lazytrain_accel.frontends.trainer_accelerator import TrainerAccelerator
from lazytrain_accel.frontends.trainer_callback import LazyTrainCallback
from lazytrain_accel.frontends.transformers import (
    LazyTrainTrainer,
    LazyTrainTrainingArguments,
    apply_lazytrain_to_trainer,
    load_lazytrain_config,
)
from lazytrain_accel.launch import split_launch_args


def _tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=32))


def test_parser_reads_flags_and_yaml_config(tmp_path: Path) -> None:
    config = tmp_path / "lt.yaml"
    config.write_text("plan: megatrain\noptimizer: keep\nmax_recompute_block: 4\n")
    parser = HfArgumentParser(LazyTrainTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--lazytrain", "--lazytrain_config", str(config),
         "--max_grad_norm", "0.5", "--use_cpu"])
    assert args.lazytrain and args.max_grad_norm == 0.5
    assert args.lazytrain_plugin.plan == "megatrain"
    assert args.lazytrain_plugin.optimizer == OptimizerChoice.KEEP
    assert args.lazytrain_plugin.max_recompute_block == 4
    assert args.place_model_on_device is False
    (plain,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu"])
    assert not plain.lazytrain and plain.lazytrain_plugin is None
    assert plain.place_model_on_device is None  # stock Trainer decides


def test_inline_json_and_errors_name_the_problem(tmp_path: Path) -> None:
    assert load_lazytrain_config('{"plan": "offload_all"}').plan == "offload_all"
    assert load_lazytrain_config({"nvme_dir": str(tmp_path)}).nvme_dir == str(tmp_path)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['max_grad_norm'\]"):
        load_lazytrain_config({"max_grad_norm": 1.0})
    with pytest.raises(ValueError, match="no such file"):
        load_lazytrain_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=r"pass a \.json/\.yaml/\.yml file"):
        load_lazytrain_config("plan=auto")
    with pytest.raises(ValueError, match="plan='bogus' is not valid"):
        load_lazytrain_config({"plan": "bogus"})


@pytest.mark.parametrize(("flag", "value", "match"), [
    ("deepspeed", "ds.json", "--deepspeed 'ds.json' cannot be combined with --lazytrain"),
    ("fsdp", "full_shard", "--fsdp 'full_shard' cannot be combined with --lazytrain"),
])
def test_deepspeed_and_fsdp_are_refused(tmp_path: Path, flag: str, value: object,
                                        match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LazyTrainTrainingArguments(output_dir=str(tmp_path), lazytrain=True, **{flag: value})


@pytest.mark.parametrize("flag", ["gradient_checkpointing", "activation_checkpointing"])
def test_hf_checkpointing_flags_are_accepted(tmp_path: Path, flag: str) -> None:
    args = LazyTrainTrainingArguments(output_dir=str(tmp_path), lazytrain=True, **{flag: True})
    assert args.lazytrain and args.activation_checkpointing  # the engine absorbs it


def test_apply_to_a_users_own_trainer_subclass(tmp_path: Path) -> None:
    class MyTrainer(Trainer):
        pass

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             optim="sgd")
    trainer = MyTrainer(model=_tiny_model(), args=args)
    stock_accelerator = trainer.accelerator
    trainer.args._n_gpu = 2  # as on a 2-GPU host, where Trainer would use nn.DataParallel
    apply_lazytrain_to_trainer(trainer, {"plan": "checkpoint_all"})
    assert trainer.args.n_gpu == 1 and trainer.place_model_on_device is False
    assert isinstance(trainer.accelerator, TrainerAccelerator)
    assert trainer.accelerator is not stock_accelerator
    assert trainer.accelerator.mixed_precision == stock_accelerator.mixed_precision
    assert isinstance(trainer.callback_handler.callbacks[0], LazyTrainCallback)
    # --optim sgd is the user's choice: kept, since hybrid8bit was not asked for by name.
    assert trainer.accelerator.lazytrain_plugin.optimizer == OptimizerChoice.KEEP
    assert "_build_accelerator_args" not in vars(trainer)
    assert apply_lazytrain_to_trainer(trainer) is trainer  # idempotent
    assert sum(isinstance(c, LazyTrainCallback) for c in trainer.callback_handler.callbacks) == 1


def test_lazytrain_trainer_is_stock_without_the_flag(tmp_path: Path) -> None:
    args = LazyTrainTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = LazyTrainTrainer(model=_tiny_model(), args=args)
    assert not isinstance(trainer.accelerator, TrainerAccelerator)
    on = LazyTrainTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                    lazytrain=True)
    trainer = LazyTrainTrainer(model=_tiny_model(), args=on)
    assert isinstance(trainer.accelerator, TrainerAccelerator)
    assert trainer.accelerator.lazytrain_plugin.optimizer == OptimizerChoice.HYBRID8BIT


def test_launch_argument_split() -> None:
    assert split_launch_args(["s.py", "--lazytrain", "--lr", "1"]) == (
        "s.py", True, None, ["--lr", "1"])
    assert split_launch_args(["s.py", "--lazytrain", "false", "--x"]) == (
        "s.py", False, None, ["--x"])
    assert split_launch_args(["s.py", "--lazytrain_config=c.yaml", "--lazytrain=true"]) == (
        "s.py", True, "c.yaml", [])
    assert split_launch_args(["s.py", "--output_dir", "o"]) == ("s.py", False, None,
                                                                ["--output_dir", "o"])
    with pytest.raises(SystemExit, match="without --lazytrain"):
        split_launch_args(["s.py", "--lazytrain_config", "c.yaml"])
    with pytest.raises(SystemExit, match="first argument must be the script"):
        split_launch_args(["--lazytrain", "s.py"])


def test_import_hook_survives_lazy_module_replacement() -> None:
    # Installed before transformers is imported; every way of reaching Trainer (lazy
    # top-level attribute, the submodule, a re-executed submodule) gets the hook.
    code = textwrap.dedent("""
        import importlib, sys
        from lazytrain_accel.config import LazyTrainConfig
        from lazytrain_accel.launch import install
        install(LazyTrainConfig(plan="checkpoint_all"))
        import transformers
        from transformers.trainer import Trainer as direct
        lazy = transformers.Trainer
        assert lazy is direct, (lazy, direct)
        assert direct.__init__._lazytrain_config.plan == "checkpoint_all"
        from transformers import Seq2SeqTrainer
        assert issubclass(Seq2SeqTrainer, direct)
        del sys.modules["transformers.trainer"]
        again = importlib.import_module("transformers.trainer").Trainer
        assert again is not direct and again.__init__._lazytrain_config.plan == "checkpoint_all"
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_evaluate_then_train_in_process(tmp_path: Path) -> None:
    """evaluate() before train() attaches the engine (no whole-model move), gives the stock
    eval loss; train() then reuses the engine and the clip reaches the fused update."""
    ids = torch.arange(8 * 12).reshape(8, 12) % 64
    data = [{"input_ids": row, "labels": row} for row in ids]
    common = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none",
              "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4,
              "max_steps": 2, "save_strategy": "no", "max_grad_norm": 0.5}
    stock = LazyTrainTrainer(model=_tiny_model(), eval_dataset=data, train_dataset=data,
                             args=LazyTrainTrainingArguments(**common))
    ours = LazyTrainTrainer(
        model=_tiny_model(), eval_dataset=data, train_dataset=data,
        args=LazyTrainTrainingArguments(**common, lazytrain=True),
        lazytrain_config={"plan": "checkpoint_all", "hardware": "h800",
                          "cache_dir": str(tmp_path / "cache"), "nvme_dir": str(tmp_path)})
    expected = stock.evaluate()["eval_loss"]
    assert ours.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-5)
    engine = ours.accelerator.lazytrain.engine
    assert engine is not None
    plan = ours.accelerator.lazytrain.run.plan
    assert (plan.batch_size, plan.seq_len) == (4, 12)  # sized from the eval loader
    ours.train()
    assert ours.accelerator.lazytrain.engine is engine  # attached once
    optimizer = ours.accelerator.lazytrain.optimizer
    assert type(optimizer).__name__ == "HybridAdamW8bit"
    assert optimizer.max_grad_norm == 0.5
    assert all(p.device.type == "cpu" for p in ours.model.parameters())
