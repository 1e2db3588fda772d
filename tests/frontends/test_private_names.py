"""Private names of torch / transformers / accelerate that LazyTrain patches or reads
(docs/architecture.md "Patched points").

Each one is a point where an upgrade can silently change behaviour (a patch that no longer
runs, a flag nobody reads). This test fails with the name and where LazyTrain uses it, so an
upgrade is caught here rather than as wrong training.
"""

from __future__ import annotations

import inspect

import accelerate
import pytest
import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer
from transformers.modeling_utils import PreTrainedModel

#: (owner, attribute, where LazyTrain relies on it)
PATCHED = [
    (Trainer, "_move_model_to_device", "frontends/transformers.py keeps the model on host"),
    (Trainer, "_build_accelerator_args", "frontends/transformers.py builds TrainerAccelerator"),
    (Trainer, "create_accelerator_and_postprocess", "frontends/transformers.py"),
    (Trainer, "_save_optimizer_and_scheduler", "frontends/transformers.py saves the plan"),
    (Trainer, "_load_optimizer_and_scheduler", "frontends/transformers.py checks the plan"),
    (Trainer, "_save_checkpoint", "frontends/trainer_checkpoint.py atomic checkpoints"),
    (Trainer, "_get_output_dir", "frontends/trainer_checkpoint.py redirects the save"),
    (Trainer, "_save", "frontends/trainer_checkpoint.py gathers a split node layout's "
     "weights on every rank first"),
    (accelerate.Accelerator, "get_state_dict",
     "frontends/accelerate.py gathers a split node layout's weights"),
    (Trainer, "_finalize_training",
     "frontends/trainer_checkpoint.py waits for a pending save before the best model loads"),
    (Trainer, "get_train_dataloader", "frontends/transformers.py sizes the plan"),
    (Trainer, "get_eval_dataloader", "frontends/transformers.py sizes the plan"),
    (PreTrainedModel, "_set_gradient_checkpointing",
     "engine/model/hf_checkpointing.py keeps it off"),
    (accelerate.Accelerator, "prepare_model", "frontends/accelerate.py streams instead"),
    (accelerate.Accelerator, "prepare_optimizer", "frontends/accelerate.py"),
    (accelerate.Accelerator, "unwrap_model", "frontends/accelerate.py waits for the update"),
    (torch.optim.Optimizer, "register_step_post_hook", "run/step.py marks a replaced one"),
]


@pytest.mark.parametrize(("owner", "name", "where"), PATCHED,
                         ids=[f"{o.__name__}.{n}" for o, n, _ in PATCHED])
def test_patched_names_exist(owner, name, where):
    assert callable(getattr(owner, name, None)), (
        f"{owner.__module__}.{owner.__name__}.{name} is gone in transformers "
        f"{transformers.__version__} / accelerate {accelerate.__version__}; LazyTrain patches "
        f"it in {where}: adapt that code before raising the upper bound in setup.cfg")


def test_read_and_written_private_state_still_exists():
    from transformers.utils import output_capturing

    from lazytrain_accel.engine.model import captures
    assert output_capturing.__name__ == captures._CAPTURING_MODULE
    assert hasattr(output_capturing, "_active_collector"), (
        "transformers.utils.output_capturing._active_collector is gone: engine/model/captures.py "
        "routes router logits (the MoE aux loss) through it; without it their gradient is lost")
    assert "_train_batch_size" in inspect.getsource(Trainer.__init__) + inspect.getsource(
        Trainer.train), "Trainer._train_batch_size (frontends/transformers.py) is gone"
    assert "_is_overflow" in inspect.getsource(AcceleratedOptimizer), (
        "AcceleratedOptimizer._is_overflow (frontends/accelerate.py step_was_skipped) is gone")
    assert "self.model.save_pretrained(" in inspect.getsource(Trainer._save), (
        "Trainer._save no longer writes the weights through model.save_pretrained: "
        "frontends/trainer_checkpoint.py leaves them to the asynchronous writer there")
    assert "_models" in vars(accelerate.Accelerator(cpu=True)), (
        "Accelerator._models (frontends/accelerate.py registers the streamed model) is gone")


def test_the_gradient_checkpointing_enable_path_goes_through_the_patched_method():
    source = inspect.getsource(PreTrainedModel._activation_checkpointing_enable)
    assert "self._set_gradient_checkpointing(" in source, (
        "PreTrainedModel no longer enables checkpointing through _set_gradient_checkpointing: "
        "engine/model/hf_checkpointing.py would not see later enables")


def test_the_checkpoint_file_names_the_node_store_save_uses_still_exist():
    """frontends/trainer_checkpoint.py writes the scheduler and reads `optimizer.pt`
    under the names the Trainer uses (the node store's checkpoint writes no optimizer.pt)."""
    from transformers import trainer, trainer_pt_utils, trainer_utils

    assert trainer.SCHEDULER_NAME == "scheduler.pt"
    assert trainer.OPTIMIZER_NAME == "optimizer.pt"
    assert trainer_utils.PREFIX_CHECKPOINT_DIR == "checkpoint"
    assert callable(trainer_pt_utils.reissue_pt_warnings)


def test_torch_names_the_run_relies_on_still_exist():
    """`model.zero_grad` is patched at attach and forwards `set_to_none`; an LR scheduler
    built on an optimizer the hybrid operator replaced reads `_opt_called`, which
    run/step.py's post-hook sets."""
    assert "set_to_none" in inspect.signature(torch.nn.Module.zero_grad).parameters
    assert "set_to_none" in inspect.signature(torch.optim.Optimizer.zero_grad).parameters
    source = inspect.getsource(torch.optim.lr_scheduler.LRScheduler)
    assert "_opt_called" in source and "_wrapped_by_lr_sched" in source, (
        "torch's LR schedulers no longer check `_opt_called`: run/step.py:_mark_stepped "
        "sets a mark nobody reads")
    assert "_optimizers" in vars(accelerate.Accelerator(cpu=True)), (
        "Accelerator._optimizers (checkpoints' stock save_state leaves ours out) is gone")
