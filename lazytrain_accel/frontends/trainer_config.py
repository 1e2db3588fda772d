"""`--lazytrain_config`: the plugin's fields given as a dict, inline JSON, or a YAML/JSON file.

Shared by `LazyTrainTrainingArguments` and the `lazytrain_accel.launch` launcher, so both
accept exactly the same values and report the same errors.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from lazytrain_accel.config import LazyTrainConfig


def plugin_field_names() -> list[str]:
    """The names `--lazytrain_config` may set (the public fields of `LazyTrainConfig`)."""
    return [f.name for f in dataclasses.fields(LazyTrainConfig) if not f.name.startswith("_")]


def load_lazytrain_config(value: LazyTrainConfig | dict[str, Any] | str | None) -> LazyTrainConfig:
    """A `LazyTrainConfig` from what a user passed as `lazytrain_config`.

    Accepts None (all defaults, `LAZYTRAIN_*` environment variables still apply), a
    `LazyTrainConfig`, a dict of its fields, an inline JSON object (``'{"plan": "auto"}'``)
    or the path of a ``.json`` / ``.yaml`` / ``.yml`` file holding such an object.
    """
    if value is None:
        return LazyTrainConfig()
    if isinstance(value, LazyTrainConfig):
        return value
    if isinstance(value, str):
        value = _read_config_text(value)
    if not isinstance(value, dict):
        raise ValueError(f"lazytrain_config={value!r} must be a mapping of LazyTrainPlugin "
                         f"fields ({', '.join(plugin_field_names())})")
    unknown = sorted(set(value) - set(plugin_field_names()))
    if unknown:
        raise ValueError(
            f"lazytrain_config has unknown field(s) {unknown}; allowed fields are "
            f"{plugin_field_names()}. Trainer settings (max_grad_norm, bf16, ...) stay "
            "ordinary TrainingArguments flags."
        )
    return LazyTrainConfig(**value)


def _read_config_text(text: str) -> Any:
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"lazytrain_config={text!r} is not a valid JSON object ({err})"
                             ) from None
    path = Path(text).expanduser()
    if path.suffix.lower() not in (".json", ".yaml", ".yml"):
        raise ValueError(f"lazytrain_config={text!r}: pass a .json/.yaml/.yml file or an "
                         "inline JSON object such as '{\"plan\": \"auto\"}'")
    if not path.is_file():
        raise ValueError(f"lazytrain_config={text!r}: no such file")
    content = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            return json.loads(content)
        except json.JSONDecodeError as err:
            raise ValueError(f"lazytrain_config file {text!r} is not valid JSON ({err})"
                             ) from None
    import yaml

    try:
        return yaml.safe_load(content) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"lazytrain_config file {text!r} is not valid YAML ({err})") from None
