"""Load a saved model with plain transformers while `lazytrain_accel` cannot be imported,
and write its logits on the ids saved by run_clm.py --logits-out.

    python load_without_lazytrain.py MODEL_DIR REFERENCE.pt OUT.pt
"""

from __future__ import annotations

import importlib.abc
import sys


class _NoLazyTrain(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname.split(".")[0] == "lazytrain_accel":
            raise ImportError("lazytrain_accel is blocked in this interpreter")
        return None


sys.meta_path.insert(0, _NoLazyTrain())

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main() -> None:
    model_dir, reference, out = sys.argv[1:4]
    ids = torch.load(reference)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    torch.save({"logits": logits, "modules": sorted(m for m in sys.modules
                                                    if m.startswith("lazytrain"))}, out)


if __name__ == "__main__":
    main()
