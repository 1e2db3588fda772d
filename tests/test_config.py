"""`LazyTrainConfig`: argument > LAZYTRAIN_* environment > default, coercion, validation."""

from __future__ import annotations

import dataclasses
import os

import pytest

from lazytrain_accel import LazyTrainPlugin
from lazytrain_accel.config import (
    ENV_PREFIX,
    STRATEGIES,
    LazyTrainConfig,
    OptimizerChoice,
    default_cache_dir,
    default_nvme_dir,
)

FIELDS = [f.name for f in dataclasses.fields(LazyTrainConfig) if not f.name.startswith("_")]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_defaults() -> None:
    config = LazyTrainConfig()
    assert config.plan == "auto" and config.hardware == "auto"
    assert config.optimizer is OptimizerChoice.HYBRID8BIT
    assert config.max_recompute_block == 8 and isinstance(config.max_recompute_block, int)
    assert config.solver_time_limit_s == 60.0 and config.max_nonfinite_skips == 3
    assert config.gpu_memory_limit_gb == config.cpu_memory_limit_gb == config.nvme_limit_gb == 0
    assert config.cache_dir.endswith(os.path.join("xdg", "lazytrain_accel"))
    assert config.nvme_dir == default_nvme_dir()
    assert not any(config.is_explicit(name) for name in FIELDS)
    assert LazyTrainPlugin is LazyTrainConfig


# One valid environment string per field, and the value it must become.
ENV_VALUES = {
    "plan": ("megatrain", "megatrain"),
    "hardware": ("RTX3090", "rtx3090"),
    "optimizer": ("KEEP", OptimizerChoice.KEEP),
    "nvme_dir": ("/mnt/nvme0", "/mnt/nvme0"),
    "gpu_memory_limit_gb": ("10.5", 10.5),
    "cpu_memory_limit_gb": ("64", 64.0),
    "nvme_limit_gb": ("100", 100.0),
    "max_recompute_block": ("4", 4),
    "solver_time_limit_s": ("2.5", 2.5),
    "cache_dir": ("~/lt-cache", os.path.expanduser("~/lt-cache")),
    "max_nonfinite_skips": ("7", 7),
    "loss_chunk_tokens": ("4096", 4096),
    "batch_size": ("8", 8),
    "seq_len": ("2048", 2048),
    "emulate_async": ("yes", True),
    "emulate_seed": ("7", 7),
    "emulate_links": ("Profile", "profile"),
    "threads": ("4", 4),
    "overlap_step": ("off", False),
    "frozen_weights": ("NF4", "nf4"),
    "resident_update": ("Device", "device"),
    "node_store": ("OFF", "off"),
    "node_layout": ("Split", "split"),
    "pin_chunk_max_gib": ("64", 64.0),
    "bind_cores": ("OFF", "off"),
    "node_store_dir": ("/dev/shm", "/dev/shm"),
    "replan": ("OFF", "off"),
    "replan_min_gain": ("0.1", 0.1),
    "checkpoint_max_shard_bytes": ("5e9", 5 * 10**9),
    "checkpoint_dtype": ("BFloat16", "bfloat16"),
    "checkpoint_mode": ("SYNC", "sync"),
    "checkpoint_write_bytes_per_s": ("1e8", 1e8),
}


def test_is_default_tells_a_built_in_default_from_the_environment(monkeypatch) -> None:
    assert LazyTrainConfig().is_default("gpu_memory_limit_gb")
    monkeypatch.setenv("LAZYTRAIN_GPU_MEMORY_LIMIT_GB", "0")  # same value, but chosen
    assert not LazyTrainConfig().is_default("gpu_memory_limit_gb")
    assert not LazyTrainConfig(plan="auto").is_default("plan")


def test_every_field_has_an_env_and_argument_case() -> None:
    assert set(ENV_VALUES) == set(FIELDS)
    assert set(ARGUMENTS) == set(FIELDS)


@pytest.mark.parametrize("name", sorted(ENV_VALUES))
def test_env_overrides_default(name: str, monkeypatch) -> None:
    raw, expected = ENV_VALUES[name]
    default = getattr(LazyTrainConfig(), name)
    monkeypatch.setenv(ENV_PREFIX + name.upper(), raw)
    config = LazyTrainConfig()
    assert getattr(config, name) == expected != default
    assert not config.is_explicit(name)


# One valid argument per field, different from its ENV_VALUES entry.
ARGUMENTS = {
    "plan": ("checkpoint_all", "checkpoint_all"),
    "hardware": ("h800", "h800"),
    "optimizer": (OptimizerChoice.HYBRID8BIT, OptimizerChoice.HYBRID8BIT),
    "nvme_dir": ("/elsewhere", "/elsewhere"),
    "gpu_memory_limit_gb": (0, 0.0),
    "cpu_memory_limit_gb": (1, 1.0),
    "nvme_limit_gb": (2.5, 2.5),
    "max_recompute_block": (2, 2),
    "solver_time_limit_s": (9, 9.0),
    "cache_dir": ("/cache", "/cache"),
    "max_nonfinite_skips": (1, 1),
    "loss_chunk_tokens": (1024, 1024),
    "batch_size": (4, 4),
    "seq_len": (512, 512),
    "emulate_async": (False, False),
    "emulate_seed": (3, 3),
    "emulate_links": ("off", "off"),
    "threads": (2, 2),
    "overlap_step": (True, True),
    "frozen_weights": ("int8", "int8"),
    "resident_update": ("host", "host"),
    "node_store": ("auto", "auto"),
    "node_layout": ("replicated", "replicated"),
    "pin_chunk_max_gib": (0.5, 0.5),
    "bind_cores": ("auto", "auto"),
    "node_store_dir": ("memfd", "memfd"),
    "replan": ("auto", "auto"),
    "replan_min_gain": (0.2, 0.2),
    "checkpoint_max_shard_bytes": (10**6, 10**6),
    "checkpoint_dtype": ("float16", "float16"),
    "checkpoint_mode": ("async", "async"),
    "checkpoint_write_bytes_per_s": (5e7, 5e7),
}


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_argument_beats_environment(name: str, monkeypatch) -> None:
    monkeypatch.setenv(ENV_PREFIX + name.upper(), ENV_VALUES[name][0])
    argument, expected = ARGUMENTS[name]
    config = LazyTrainConfig(**{name: argument})
    assert getattr(config, name) == expected != ENV_VALUES[name][1]
    assert config.is_explicit(name)


def test_empty_env_var_counts_as_unset(monkeypatch) -> None:
    monkeypatch.setenv("LAZYTRAIN_MAX_RECOMPUTE_BLOCK", "")
    monkeypatch.setenv("LAZYTRAIN_PLAN", "   ")
    config = LazyTrainConfig()
    assert config.max_recompute_block == 8 and config.plan == "auto"


def test_strings_coerce_to_enums_and_numbers() -> None:
    config = LazyTrainConfig(optimizer=" Keep ", max_recompute_block="3",
                             gpu_memory_limit_gb="1e1", plan="MegaTrain", hardware="AUTO")
    assert config.optimizer is OptimizerChoice.KEEP
    assert config.max_recompute_block == 3 and config.gpu_memory_limit_gb == 10.0
    assert config.plan == "megatrain" and config.hardware == "auto"
    assert config.to_dict()["optimizer"] == "keep"


def test_to_dict_round_trips() -> None:
    config = LazyTrainConfig(plan="offload_all", max_recompute_block=5, hardware="a100-40g")
    again = LazyTrainConfig(**config.to_dict())
    assert again.to_dict() == config.to_dict()
    assert set(config.to_dict()) == set(FIELDS)


# Every validation error: (field, bad value, words the message must contain).
BAD = [
    ("plan", "fastest", ["plan='fastest'", "'auto'", *STRATEGIES[:1], "JSON"]),
    ("plan", "/nowhere/plan.json", ["no such plan file", "lazytrain plan"]),
    ("hardware", "tpu", ["hardware='tpu'", "'auto'", "h800"]),
    ("hardware", "/nowhere/hw.json", ["no such hardware JSON file"]),
    ("optimizer", "sgd", ["optimizer='sgd'", "hybrid8bit", "keep"]),
    ("nvme_dir", "", ["nvme_dir=''", "non-empty"]),
    ("cache_dir", 3, ["cache_dir=3", "non-empty string"]),
    ("gpu_memory_limit_gb", -1, ["gpu_memory_limit_gb=-1", ">= 0"]),
    ("cpu_memory_limit_gb", "lots", ["cpu_memory_limit_gb='lots'", "finite number"]),
    ("nvme_limit_gb", float("nan"), ["nvme_limit_gb=nan", "finite number"]),
    ("max_recompute_block", 0, ["max_recompute_block=0", ">= 1"]),
    ("max_recompute_block", 2.5, ["max_recompute_block=2.5", "integer"]),
    ("max_recompute_block", True, ["max_recompute_block=True", "number"]),
    ("solver_time_limit_s", 0, ["solver_time_limit_s=0", "> 0"]),
    ("emulate_async", "maybe", ["emulate_async='maybe'", "boolean"]),
    ("emulate_links", "fast", ["emulate_links='fast'", "profile"]),
    ("solver_time_limit_s", "inf", ["solver_time_limit_s='inf'", "finite"]),
    ("max_nonfinite_skips", 0, ["max_nonfinite_skips=0", ">= 1"]),
    ("loss_chunk_tokens", -1, ["loss_chunk_tokens=-1", ">= 0"]),
    ("loss_chunk_tokens", 1.5, ["loss_chunk_tokens=1.5", "integer"]),
    ("seq_len", -2, ["seq_len=-2", ">= 0"]),
    ("batch_size", 0.5, ["batch_size=0.5", "integer"]),
    ("overlap_step", "sometimes", ["overlap_step='sometimes'", "boolean"]),
    ("frozen_weights", "nf3", ["frozen_weights='nf3'", "keep", "nf4", "int8"]),
    ("resident_update", "gpu", ["resident_update='gpu'", "auto", "host", "device"]),
    ("node_store", "on", ["node_store='on'", "auto", "off"]),
    ("node_layout", "halves", ["node_layout='halves'", "replicated", "split"]),
    ("node_store_dir", "/no/such/dir", ["node_store_dir='/no/such/dir'", "not a directory",
                                        "'memfd'"]),
    ("replan", "always", ["replan='always'", "auto", "off"]),
    ("replan_min_gain", 1.5, ["replan_min_gain=1.5", "between 0 and 1"]),
    ("pin_chunk_max_gib", 0, ["pin_chunk_max_gib=0", "must be > 0"]),
    ("bind_cores", "yes", ["bind_cores='yes'", "auto", "off"]),
    ("checkpoint_mode", "later", ["checkpoint_mode='later'", "async", "sync"]),
    ("checkpoint_write_bytes_per_s", -1, ["checkpoint_write_bytes_per_s=-1", ">= 0"]),
    ("emulate_links", "/nowhere/links.json", ["emulate_links='/nowhere/links.json'",
                                              "no such hardware JSON"]),
]


@pytest.mark.parametrize(("name", "value", "words"), BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_validation_errors_name_field_value_and_fix(name, value, words) -> None:
    with pytest.raises(ValueError) as info:
        LazyTrainConfig(**{name: value})
    for word in words:
        assert word in str(info.value)


def test_env_errors_name_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("LAZYTRAIN_MAX_RECOMPUTE_BLOCK", "four")
    with pytest.raises(ValueError, match="environment variable LAZYTRAIN_MAX_RECOMPUTE_BLOCK"):
        LazyTrainConfig()
    monkeypatch.delenv("LAZYTRAIN_MAX_RECOMPUTE_BLOCK")
    monkeypatch.setenv("LAZYTRAIN_OPTIMIZER", "adam")
    with pytest.raises(ValueError, match=r"optimizer='adam'.*LAZYTRAIN_OPTIMIZER"):
        LazyTrainConfig()


def test_json_paths_are_accepted_when_they_exist(tmp_path) -> None:
    from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS

    hw_path = tmp_path / "Machine.JSON.json"
    HARDWARE_PRESETS["h800"].save(hw_path)
    plan_path = tmp_path / "Plan.json"
    plan_path.write_text("{}")
    config = LazyTrainConfig(hardware=str(hw_path), plan=str(plan_path))
    assert config.hardware == str(hw_path) and config.plan == str(plan_path)  # case kept


def test_emulate_links_takes_a_hardware_json(tmp_path) -> None:
    from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS

    path = tmp_path / "Links.json"
    HARDWARE_PRESETS["rtx3090"].save(path)
    assert LazyTrainConfig(emulate_links=str(path)).emulate_links == str(path)  # case kept


def test_default_dirs_follow_their_env_vars(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LAZYTRAIN_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("LAZYTRAIN_NVME_DIR", str(tmp_path / "n"))
    assert default_cache_dir() == str(tmp_path / "c")
    assert default_nvme_dir() == str(tmp_path / "n")


def test_env_setting_reads_one_field_without_a_config(monkeypatch) -> None:
    from lazytrain_accel.config import env_setting

    assert env_setting("emulate_async") is False and env_setting("emulate_links") == "off"
    monkeypatch.setenv("LAZYTRAIN_EMULATE_ASYNC", "1")
    monkeypatch.setenv("LAZYTRAIN_EMULATE_SEED", "12")
    assert env_setting("emulate_async") is True and env_setting("emulate_seed") == 12
    monkeypatch.setenv("LAZYTRAIN_EMULATE_LINKS", "sometimes")
    with pytest.raises(ValueError, match="LAZYTRAIN_EMULATE_LINKS"):
        env_setting("emulate_links")


def test_nvme_dir_names_one_directory_per_drive(monkeypatch) -> None:
    """A list, or a string joined by "," (the environment's form): expanded, in order,
    repeats dropped; an empty entry is an error naming the field."""
    home = os.path.expanduser("~")
    assert LazyTrainConfig(nvme_dir=["~/a", "/b", "/b"]).nvme_dir == f"{home}/a,/b"
    assert LazyTrainConfig(nvme_dir=" /x , /y ").nvme_dir == "/x,/y"
    monkeypatch.setenv("LAZYTRAIN_NVME_DIR", "/p,/q")
    assert LazyTrainConfig().nvme_dir == "/p,/q"
    for bad in (["/a", ""], "/a,,/b", [], 3):
        with pytest.raises(ValueError, match="nvme_dir="):
            LazyTrainConfig(nvme_dir=bad)
