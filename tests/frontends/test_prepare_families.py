"""`prepare` takes any decoder-only family: profiles come from the live model, not a table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import batches, build_model, twin

from lazytrain_accel import Accelerator, LazyTrainPlugin


@pytest.mark.parametrize("arch", ["gpt_bigcode", "mixtral", "falcon"])
def test_prepare_trains_families_outside_the_table_and_moe_like_plain_pytorch(arch, tmp_path):
    ref = build_model(arch, 3)
    model = twin(ref)
    plugin = LazyTrainPlugin(plan="auto", hardware="h800", optimizer="keep",
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    data = batches(3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(data)),
                                         batch_size=2)
    acc = Accelerator(cpu=True, plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert acc.lazytrain.run.model_profile.geometry.family == arch
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step, ids in enumerate(data):
        torch.manual_seed(step)  # same dropout masks for both
        ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        torch.manual_seed(step)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6, msg=name)
    acc.end_training()
