"""The plugin runs on the emulated async device when asked, throttled to its profile."""

from __future__ import annotations

import torch
from test_accelerate_plugin import _loader, _model

from lazytrain_accel import Accelerator, LazyTrainPlugin
from lazytrain_accel.engine.device.emulation import EmulatedStreams
from lazytrain_accel.profiling.hardware_spec import load_hardware


def test_env_turns_the_emulation_on_with_profile_rates(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LAZYTRAIN_EMULATE_ASYNC", "1")
    monkeypatch.setenv("LAZYTRAIN_EMULATE_SEED", "8")
    monkeypatch.setenv("LAZYTRAIN_EMULATE_LINKS", "profile")
    plugin = LazyTrainPlugin(plan="offload_all", hardware="h800", optimizer="keep",
                             cache_dir=str(tmp_path / "cache"), nvme_dir=str(tmp_path / "nvme"))
    model, loader = _model(), _loader()
    acc = Accelerator(cpu=True, plugin=plugin)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    streams = acc.lazytrain.engine.streams
    assert isinstance(streams, EmulatedStreams) and streams.seed == 8
    h800 = load_hardware("h800")
    assert streams.settings.link_bytes_per_s == {
        "h2d": h800.h2d_bytes_per_s, "d2h": h800.d2h_bytes_per_s,
        "nvme_read": h800.nvme_read_bytes_per_s, "nvme_write": h800.nvme_write_bytes_per_s}
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)
    acc.end_training()
