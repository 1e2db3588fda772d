"""A script that ends right after training exits 0: no LazyTrain thread is left inside
torch while the interpreter finalizes (a daemon thread taking the GIL back then is ended
from inside a C++ destructor: "terminate called without an active exception", -6)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Ends right after `optimizer.step()`: the layer-wise update of the last step still runs.
#: Planned on a preset, not `hardware="auto"`: measuring this machine took ~90% of the run.
ENDS_AFTER_STEP = """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from lazytrain_accel import Accelerator, LazyTrainPlugin

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    acc = Accelerator(cpu=True, plugin=LazyTrainPlugin(optimizer="hybrid8bit", plan="offload_all",
                                                       hardware="h800", cache_dir={cache!r}))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
"""

#: Ends with copies still queued on an emulated stream. The check is a finalizer made
#: before the streams' own, so it runs after it at exit (finalizers run newest first).
ENDS_WITH_QUEUED_COPIES = """
    import os, threading, weakref
    import torch
    from lazytrain_accel.engine.device.emulation import EmulatedStreams, EmulationSettings

    def no_worker_left() -> None:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("lazytrain-")]
        if alive:
            print("still running at exit:", alive, flush=True)
            os._exit(3)

    class Anchor: pass
    anchor = Anchor()
    weakref.finalize(anchor, no_worker_left)
    streams = EmulatedStreams(torch.device("cpu"), EmulationSettings(jitter_s=0.0))
    src, dst = torch.ones(512, 512).t(), torch.empty(512, 512)
    with streams.copy_stream("h2d"):
        for _ in range(300):
            streams.copy_(dst, src)
"""


@pytest.mark.parametrize("script", [ENDS_AFTER_STEP, ENDS_WITH_QUEUED_COPIES],
                         ids=["layerwise-update", "emulated-streams"])
def test_a_script_ending_with_work_in_flight_exits_cleanly(script: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LAZYTRAIN_EMULATE_ASYNC": "1",
           "OMP_NUM_THREADS": "1"}
    code = textwrap.dedent(script).format(cache=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
