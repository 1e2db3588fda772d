"""The plugin's overlapped hybrid 8-bit step against its serial step, in one process.

A Qwen2-style model (8 layers, hidden 256) trained through the Accelerate plugin
(`megatrain` plan, batch 4 x seq 128) with `overlap_step=True` and `False`, alternated
`--repeats` times; each run's step is the median time from one step's start to the next
(so an update still running when the next step begins counts only where it is exposed).
Prints the ratio overlapped / serial. On a CPU-only device the update's thread competes
with the forward for the same cores: a ratio near 1 is what to expect there; the overlap
pays where the forward runs on a GPU.

    python bench/step_overlap.py [--repeats 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from lazytrain_accel import Accelerator, LazyTrainPlugin


def _model() -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=704,
                                      num_hidden_layers=8, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "eager"
    config.use_cache = False
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def step_s(overlap: bool, device: str, tmp: Path) -> float:
    ids = torch.randint(0, 1024, (32, 128), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)
    plugin = LazyTrainPlugin(plan="megatrain", hardware="h800", cache_dir=str(tmp / "c"),
                             nvme_dir=str(tmp / "n"), overlap_step=overlap)
    acc = Accelerator(cpu=device == "cpu", plugin=plugin)
    model = _model()
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    starts = []
    for (batch,) in loader:
        starts.append(time.perf_counter())
        acc.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
    acc.wait_for_everyone()
    starts.append(time.perf_counter())
    acc.end_training()
    return statistics.median([b - a for a, b in itertools.pairwise(starts)][2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for overlap in (False, True):
            runs[overlap].append(step_s(overlap, args.device, tmp))
    serial, overlapped = statistics.median(runs[False]), statistics.median(runs[True])
    print(f"step: serial {serial * 1e3:.0f} ms, overlapped {overlapped * 1e3:.0f} ms, "
          f"ratio overlapped/serial {overlapped / serial:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
