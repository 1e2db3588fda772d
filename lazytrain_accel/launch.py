"""Run an unmodified HF Trainer script with LazyTrain.

    python -m lazytrain_accel.launch SCRIPT.py --lazytrain [--lazytrain_config CFG] ARGS...
    accelerate launch -m lazytrain_accel.launch SCRIPT.py --lazytrain ARGS...

`--lazytrain` and `--lazytrain_config` (a YAML/JSON file or an inline JSON object of
`LazyTrainPlugin` fields) are taken out: the script sees only its own ARGS. Without
`--lazytrain` nothing is imported or patched. With it, every `transformers.Trainer`
(subclasses included) gets `apply_lazytrain_to_trainer`, through a hook on the class of
`transformers.trainer`, installed by an import hook each time that module executes
(transformers' lazy module loses or bypasses a patched name). docs/trainer.md
"Unmodified scripts".
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from lazytrain_accel.config import LazyTrainConfig

TRAINER_MODULE = "transformers.trainer"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

USAGE = ("usage: python -m lazytrain_accel.launch SCRIPT.py [--lazytrain] "
         "[--lazytrain_config CFG] [SCRIPT ARGS...]")


def split_launch_args(argv: Sequence[str]) -> tuple[str, bool, str | None, list[str]]:
    """(script, lazytrain on?, lazytrain_config or None, the script's own arguments).

    `--lazytrain` may stand alone or take a boolean (`--lazytrain true`, as
    `HfArgumentParser` writes bools); `--lazytrain_config X` or `--lazytrain_config=X`.
    """
    if not argv or argv[0].startswith("-"):
        raise SystemExit(f"{USAGE}\nthe first argument must be the script to run")
    script, rest = argv[0], list(argv[1:])
    enabled, config, remaining = False, None, []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--lazytrain":
            enabled = True
            if i + 1 < len(rest) and rest[i + 1].lower() in _TRUE + _FALSE:
                enabled = rest[i + 1].lower() in _TRUE
                i += 1
        elif arg.startswith("--lazytrain="):
            value = arg.split("=", 1)[1].lower()
            if value not in _TRUE + _FALSE:
                raise SystemExit(f"--lazytrain={value!r}: use true or false")
            enabled = value in _TRUE
        elif arg == "--lazytrain_config":
            if i + 1 >= len(rest):
                raise SystemExit("--lazytrain_config needs a value (a .yaml/.json file or "
                                 "an inline JSON object)")
            config = rest[i + 1]
            i += 1
        elif arg.startswith("--lazytrain_config="):
            config = arg.split("=", 1)[1]
        else:
            remaining.append(arg)
        i += 1
    if config is not None and not enabled:
        raise SystemExit("--lazytrain_config was given without --lazytrain; add --lazytrain "
                         "to train with LazyTrain, or drop --lazytrain_config")
    return script, enabled, config, remaining


# ---- the Trainer hook ---------------------------------------------------------------
def patch_trainer_class(trainer_cls: type, config: LazyTrainConfig) -> None:
    """Make every `trainer_cls(...)` (and subclass) a LazyTrain Trainer with `config`."""
    if getattr(trainer_cls.__init__, "_lazytrain_config", None) is not None:
        trainer_cls.__init__._lazytrain_config = config
        return
    original = trainer_cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        from lazytrain_accel.frontends import transformers as integration
        integration.prepare_trainer_init(self)
        original(self, *args, **kwargs)
        integration.apply_lazytrain_to_trainer(self, __init__._lazytrain_config)

    __init__._lazytrain_config = config
    trainer_cls.__init__ = __init__


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then calls `after(module)` once it has executed."""

    def __init__(self, loader: importlib.abc.Loader, after: Callable[[ModuleType], None]):
        self._loader = loader
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._after(module)


class TrainerImportHook(importlib.abc.MetaPathFinder):
    """Patches `transformers.trainer.Trainer` whenever that module is (re)executed."""

    def __init__(self, config: LazyTrainConfig) -> None:
        self.config = config

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TRAINER_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self._patch)
                return spec
        return None

    def _patch(self, module: ModuleType) -> None:
        patch_trainer_class(module.Trainer, self.config)


def install(config: LazyTrainConfig) -> TrainerImportHook:
    """Install the hook (and patch an already-imported `transformers.trainer`)."""
    hook = TrainerImportHook(config)
    sys.meta_path.insert(0, hook)
    loaded = sys.modules.get(TRAINER_MODULE)
    if loaded is not None and hasattr(loaded, "Trainer"):
        patch_trainer_class(loaded.Trainer, config)
    return hook


def main(argv: Sequence[str] | None = None) -> None:
    script, enabled, config_text, script_args = split_launch_args(
        sys.argv[1:] if argv is None else argv)
    if not os.path.isfile(script):
        raise SystemExit(f"{USAGE}\nno such script: {script!r}")
    if enabled:
        from lazytrain_accel.frontends.trainer_config import load_lazytrain_config

        try:
            install(load_lazytrain_config(config_text))
        except ValueError as err:  # a bad config: say so before the script starts
            raise SystemExit(f"lazytrain_accel.launch: {err}") from None
    sys.argv = [script, *script_args]
    # As `python SCRIPT.py` does: the script's directory, not the working directory, first.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
