"""Whether a model's decoder layers can run in sequence tiles, decided from its config once.

A sequence-tiled layer (`engine/sequence/layer_tiles.py`) runs whole instead where it cannot run in
tiles, and its backward working set is then the untiled one (the MLP in tiles, attention
in query blocks: q, o, dO, dQ of the whole sequence, its norms' outputs and residual
whole), several times the tiled one at long sequence. The planner has to size such a layer
as it will run, so the decision is made here, from the model's config alone, and read by
both sides: the profile's geometry (`ModelGeometry.whole_layer_reason`, set by
`families.geometry_from_config` and `live.geometry_from_model`), which the working set
reads (`working_set.layer_working_set`), and the engine (`Runtime`), whose layers then run
whole from their first call without trying tiles.

What the config decides:

* an MoE layer recording its router logits (`output_router_logits`, the auxiliary loss):
  its router hands them to transformers' output collector, once per call, which a layer
  run in tiles would do once per tile;
* attention declared non-causal (`is_causal` False in the config): a tile's queries see
  only the key prefix.

What no config says is still found by the engine at a layer's first tiled call
(`layer_tiles.Unsupported`: attention called other than once per tile, extra outputs, a
collector fed some other way, a mask without causal structure) or per call (a kwarg that
needs a gradient; a forward that depends on the grad mode, `quantized`); the engine then
runs the layer whole and warns that the plan sized it as tiled.
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
