"""The hybrid 8-bit CPU optimizer: AdamW with blockwise 8-bit moments, clipping fused in.

See docs/optimizer.md. `HybridAdamW8bit` is the public entry; `codes` and `reference`
hold the quantization and the pure-torch oracle of the native kernel.
"""

from lazytrain_accel.optim.codes import EXP_AVG_CODE, EXP_AVG_SQ_CODE, FloatCode
from lazytrain_accel.optim.hybrid_adamw8bit import HybridAdamW8bit
from lazytrain_accel.optim.native import load_kernel

__all__ = ["EXP_AVG_CODE", "EXP_AVG_SQ_CODE", "FloatCode", "HybridAdamW8bit", "load_kernel"]
