"""Find the decoder stack of a HF causal LM generically, without a per-family table."""

from __future__ import annotations

from torch import nn


class UnsupportedModelError(ValueError):
    """The model has no stack of identical decoder blocks the engine could stream."""


def _module_lists(model: nn.Module) -> list[tuple[nn.Module, str, nn.ModuleList]]:
    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and len(child) > 0:
                found.append((parent, attr, child))
    return found


def _all_of_class(blocks: nn.ModuleList, names: set[str] | None) -> bool:
    first = type(blocks[0])
    if names is not None and first.__name__ not in names:
        return False
    return all(type(b) is first for b in blocks)


def find_decoder_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """Return (parent, attribute name, ModuleList) of the model's decoder layers.

    Prefers ModuleLists whose blocks are all of one class named in the model's
    `_no_split_modules` (HF's own "a layer is an indivisible unit" hint); otherwise the
    largest ModuleList of identical blocks holding parameters.
    """
    lists = _module_lists(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    candidates = [entry for entry in lists if _all_of_class(entry[2], set(no_split))]
    if not candidates:
        candidates = [
            entry for entry in lists
            if _all_of_class(entry[2], None) and any(True for _ in entry[2][0].parameters())
        ]
    if not candidates:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no ModuleList of identical decoder blocks (its "
            f"_no_split_modules is {list(no_split)!r}); the streaming engine needs a "
            "decoder-only model whose layers are one repeated block class"
        )
    return max(candidates, key=lambda entry: len(entry[2]))
