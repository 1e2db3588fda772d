"""What a Trainer run under LazyTrain says: few lines, honest ones, in the right places."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainingArguments

from lazytrain_accel.frontends.transformers import LazyTrainTrainer

MODEL = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_trainer_run_logs_the_swap_once_and_keeps_metrics_off_the_console(
        tmp_path, caplog, capsys):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(MODEL)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                             max_steps=2, save_steps=2, logging_steps=1, disable_tqdm=True,
                             per_device_train_batch_size=4, log_level="info")
    trainer = LazyTrainTrainer(model=model, args=args, train_dataset=_Rows(),
                               lazytrain_config={"plan": "checkpoint_all", "hardware": "h800",
                                                 "cache_dir": str(tmp_path / "cache")})
    with caplog.at_level(logging.INFO):
        trainer.train()
    ours = [r for r in caplog.records if r.name == "lazytrain_accel"]
    assert not [r.getMessage() for r in ours if r.levelno >= logging.WARNING]
    swaps = [r.getMessage() for r in ours if "replaced by HybridAdamW8bit" in r.getMessage()]
    assert len(swaps) == 1 and "optimizer='keep'" in swaps[0]
    assert sum("LazyTrain plan" in r.getMessage() for r in ours) == 1
    saves = [r.getMessage() for r in caplog.records if "Saving model checkpoint" in r.getMessage()]
    assert saves and all("staging" not in m and str(tmp_path / "out") in m for m in saves)
    console = capsys.readouterr().out
    assert "'loss'" in console and "lazytrain/" not in console
    history = trainer.state.log_history
    assert any("lazytrain/step_s_measured" in e for e in history)
    assert any("lazytrain/plan_step_s_predicted" in e for e in history)


class _OverflowAtStep1(LazyTrainTrainer):
    """The second optimizer step's loss (and so its gradients) is inf."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * float("inf") if self.state.global_step == 1 else loss


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_logs_count_a_skipped_step_once(tmp_path):
    """The Trainer's logs read the run's one count of skipped steps."""
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                             max_steps=3, save_strategy="no", logging_steps=1,
                             disable_tqdm=True, per_device_train_batch_size=4)
    trainer = _OverflowAtStep1(model=Qwen2ForCausalLM(MODEL), args=args,
                               train_dataset=_Rows(),
                               lazytrain_config={"plan": "checkpoint_all", "hardware": "h800",
                                                 "cache_dir": str(tmp_path / "cache")})
    trainer.train()
    counts = [e["lazytrain/skipped_steps"] for e in trainer.state.log_history
              if "lazytrain/skipped_steps" in e]
    assert counts == [0, 1, 1]
    assert trainer.accelerator.lazytrain.guard.skipped_steps == 1
