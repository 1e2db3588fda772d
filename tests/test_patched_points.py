"""The private names of torch, accelerate and transformers that LazyTrain patches or sets
(docs/architecture.md "Patched points"): each test fails when the library it was written
against renames or drops the name, before a run silently stops doing what it did."""

from __future__ import annotations

import inspect

import accelerate
import pytest
import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer


@pytest.mark.parametrize("name", [
    "_move_model_to_device", "_build_accelerator_args", "get_train_dataloader",
    "get_eval_dataloader", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
    "_save_checkpoint", "_finalize_training", "_get_output_dir"])
def test_the_trainer_methods_lazytrain_overrides_still_exist(name: str) -> None:
    assert callable(getattr(Trainer, name, None)), (
        f"transformers.Trainer.{name} is gone: frontends/ overrides it on the instance")


def test_the_trainer_still_has_a_gather_function() -> None:
    assert "self.gather_function" in inspect.getsource(Trainer.create_accelerator_and_postprocess)


def test_accelerate_still_reads_is_overflow_and_keeps_models_and_optimizers() -> None:
    assert "_is_overflow" in inspect.getsource(AcceleratedOptimizer.step_was_skipped.fget)
    init = inspect.getsource(accelerate.Accelerator.__init__)
    assert "self._models = []" in init and "self._optimizers = []" in init


def test_torch_lr_schedulers_still_check_opt_called() -> None:
    source = inspect.getsource(torch.optim.lr_scheduler.LRScheduler)
    assert "_opt_called" in source and "_wrapped_by_lr_sched" in source


def test_zero_grad_and_step_are_still_plain_methods_with_set_to_none() -> None:
    assert "set_to_none" in inspect.signature(torch.nn.Module.zero_grad).parameters
    assert "set_to_none" in inspect.signature(torch.optim.Optimizer.zero_grad).parameters
    assert callable(getattr(torch.optim.Optimizer, "register_step_post_hook", None))

