"""Whether a model's decoder layers can run in sequence tiles, decided from its config once.

A layer that cannot runs whole, with a much larger backward working set at long sequence,
so the planner must size it as it will run: the decision is made here, from the config
alone, and read by both sides (`ModelGeometry.whole_layer_reason` for the working set,
`Runtime` for the engine, whose layers then never try tiles). The config decides: an MoE
layer recording its router logits (`output_router_logits`), attention declared
non-causal. What no config says the engine finds at a layer's first tiled call
(`layer_tiles.Unsupported`) or per call; it then runs the layer whole and warns that the
plan sized it as tiled. Docs: docs/planner.md "Long context" ("Layers that run whole").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Config keys counting routed experts (an MoE layer), as `live.py` reads them.
EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def whole_layer_reason(config: Any) -> str:
    """Why the decoder layers of a model with `config` (a HF config object or its dict;
    a multimodal model's `text_config` is read when present) cannot run in sequence tiles,
    or "" where they can."""
    text = _get(config, "text_config")
    if text is not None:
        config = text
    experts = next((v for v in (_get(config, k) for k in EXPERTS_KEYS)
                    if isinstance(v, int) and not isinstance(v, bool)), 0)
    if experts > 0 and _get(config, "output_router_logits"):
        return ("its MoE router logits are recorded (output_router_logits=True): the router "
                "hands them to transformers' output collector once per call")
    if _get(config, "is_causal") is False:
        return "its attention is not causal (is_causal=False)"
    return ""
