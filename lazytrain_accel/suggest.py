""""Did you mean ...?" for a mistyped name (preset, strategy, subcommand); stdlib only."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

#: `owner/name` as the Hugging Face Hub spells a repository id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`"did you mean 'h800'? "` for the closest of `choices`, or "" when none is close."""
    close = difflib.get_close_matches(word.strip().lower(), list(choices), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def hub_id_hint(spec: str, *, presets: bool = True) -> str:
    """A sentence for a `--model` that looks like a Hub id (`Qwen/Qwen2.5-7B`), else ""."""
    if not _HUB_ID.match(spec.strip()):
        return ""
    return (f"hub ids are not downloaded: pass a local directory{' or a preset' * presets} "
            "(`huggingface-cli download` writes one); ")
