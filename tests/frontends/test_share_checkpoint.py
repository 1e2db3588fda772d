"""Share checkpoints (checkpoints/share_format.py, publication.py, resume.py and
frontends/share_checkpoint.py), in process with fake shares: the weights file
`from_pretrained` loads, the optimizer state per share, re-sharding onto another world
size, and the refusals."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from lazytrain_accel.checkpoints import resume
from lazytrain_accel.checkpoints import share_format as sc
from lazytrain_accel.frontends import share_checkpoint
from lazytrain_accel.optim import HybridAdamW8bit


def _model(seed: int = 0, *, tied: bool = True) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tied))


def _into_one_storage(model: torch.nn.Module) -> None:
    """What the node store does: every parameter a view of one flat buffer."""
    params = [p for _, p in model.named_parameters()]
    flat = torch.empty(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        view = flat[offset:offset + p.numel()].view(p.shape)
        view.copy_(p.data)
        p.data = view
        offset += p.numel()


def _trained(optimizer_cls: type, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    _into_one_storage(model)
    kwargs = {"backend": "torch"} if optimizer_cls is HybridAdamW8bit else {}
    optimizer = optimizer_cls(model.parameters(), lr=1e-2, **kwargs)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.param_groups[0]["lr"] = 0.0123  # a scheduler moved it
    return model, optimizer


def _shares(params: list[torch.nn.Parameter], n: int) -> list[list[torch.nn.Parameter]]:
    """n contiguous runs of parameters (fake owners)."""
    cut = [len(params) * i // n for i in range(n + 1)]
    return [params[cut[i]:cut[i + 1]] for i in range(n)]


def _save(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          n: int) -> dict:
    directory.mkdir()
    names = sc.param_names(model)
    shares = []
    for rank, share in enumerate(_shares(list(model.parameters()), n)):
        written = sc.write_share(directory / sc.share_file(rank), optimizer, share, names)
        shares.append({"rank": rank, "groups": [], "file": sc.share_file(rank),
                       "params": written, "optimizer_steps": sc.max_step(optimizer, share)})
    sc.write_weights(directory, model)
    manifest = sc.build_manifest(world_size=n, local_world_size=n, nodes=1, step=7,
                                 layout=sc.layout_hash(model),
                                 optimizer=sc.optimizer_record(optimizer, names),
                                 shares=shares)
    (directory / sc.MANIFEST).write_text(json.dumps(manifest))
    return manifest


def _state_bytes(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    names = sc.param_names(model)
    return {(names[p], k): (v.clone() if isinstance(v, torch.Tensor) else v)
            for p, s in optimizer.state.items() for k, v in s.items()}


def test_weights_are_written_once_and_from_pretrained_loads_them(tmp_path: Path) -> None:
    model = _model(tied=True)
    _into_one_storage(model)  # stock safetensors de-dup would keep one tensor of all
    sc.write_weights(tmp_path, model)
    saved = load_file(tmp_path / sc.WEIGHTS)
    assert "lm_head.weight" not in saved  # the tied alias, once
    assert set(saved) == {n for n, _ in model.named_parameters()}
    loaded = Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, p), (name2, q) in zip(model.state_dict().items(),
                                     loaded.state_dict().items(), strict=True):
        assert name == name2
        assert torch.equal(p, q), name


@pytest.mark.parametrize("optimizer_cls", [HybridAdamW8bit, torch.optim.AdamW])
@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 2), (2, 3), (3, 1)])
def test_the_state_per_share_reshards_onto_any_world_size(
        tmp_path: Path, optimizer_cls: type, saved_by: int, loaded_by: int) -> None:
    model, optimizer = _trained(optimizer_cls)
    manifest = _save(tmp_path / "ckpt", model, optimizer, saved_by)
    assert sum(len(s["params"]) for s in manifest["shares"]) == len(optimizer.state)
    assert manifest["optimizer_steps"] == 2
    expected = _state_bytes(optimizer, model)

    union: dict = {}
    fresh, _ = _model(seed=5), None
    _into_one_storage(fresh)
    for share in _shares(list(fresh.parameters()), loaded_by):  # each new rank
        kwargs = {"backend": "torch"} if optimizer_cls is HybridAdamW8bit else {}
        new = optimizer_cls(fresh.parameters(), lr=1.0, **kwargs)
        ids = {id(p) for p in share}
        sc.check_layout(manifest, fresh, world_size=loaded_by)
        resume.load_optimizer(new, tmp_path / "ckpt", manifest, sc.param_names(fresh),
                              lambda p, ids=ids: id(p) in ids, world_size=loaded_by)
        assert new.param_groups[0]["lr"] == 0.0123
        assert new.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]
        assert set(new.state) <= set(share)
        union.update(_state_bytes(new, fresh))
    assert union.keys() == expected.keys()
    for key, value in expected.items():
        got = union[key]
        assert got.dtype == value.dtype and torch.equal(got, value), key


def test_a_rank_loads_only_the_masters_it_owns(tmp_path: Path) -> None:
    model, optimizer = _trained(torch.optim.AdamW)
    _save(tmp_path / "ckpt", model, optimizer, 2)
    fresh = _model(seed=5)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    owned = {id(p) for p in _shares(list(fresh.parameters()), 2)[1]}
    count = resume.load_weights(fresh, tmp_path / "ckpt", loads=lambda t: id(t) in owned)
    assert count == len(owned)
    for (name, p), q in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q if id(p) in owned else before[name]), name


def test_a_stock_optimizer_file_is_one_share(tmp_path: Path) -> None:
    model, optimizer = _trained(HybridAdamW8bit)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.bin")
    fresh = _model(seed=5)
    new = HybridAdamW8bit(fresh.parameters(), lr=1.0, backend="torch")
    first = set(list(fresh.parameters())[:4])
    resume.load_stock_optimizer(new, tmp_path / "optimizer.bin", lambda p: p in first)
    assert set(new.state) == first
    for p, q in zip(list(fresh.parameters())[:4], model.parameters(), strict=False):
        for key, value in optimizer.state[q].items():
            assert new.state[p][key].dtype == value.dtype and torch.equal(new.state[p][key],
                                                                          value), key


def test_what_cannot_be_resharded_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    model, optimizer = _trained(torch.optim.AdamW)
    manifest = _save(tmp_path / "ckpt", model, optimizer, 2)
    other = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"written by 2 ranks\) is for another model.*on 3"):
        sc.check_layout(manifest, other, world_size=3)
    fresh = _model(seed=5)
    names = sc.param_names(fresh)
    refused = r"holds AdamW state \(written by 2 ranks\).*\(on 3\) is HybridAdamW8bit"
    with pytest.raises(ValueError, match=refused):
        resume.load_optimizer(HybridAdamW8bit(fresh.parameters(), backend="torch"),
                              tmp_path / "ckpt", manifest, names, lambda p: True, world_size=3)
    (tmp_path / "ckpt" / sc.share_file(1)).unlink()
    with pytest.raises(ValueError, match="re-shard the checkpoint written by 2 ranks onto 3"):
        resume.load_optimizer(torch.optim.AdamW(fresh.parameters()), tmp_path / "ckpt",
                              manifest, names, lambda p: True, world_size=3)


def test_the_manifest_records_the_launch_and_every_share(tmp_path: Path) -> None:
    model, optimizer = _trained(HybridAdamW8bit)
    manifest = _save(tmp_path / "ckpt", model, optimizer, 2)
    assert set(manifest) == set(sc.MANIFEST_FIELDS)
    read = sc.read_manifest(tmp_path / "ckpt")
    assert read["world_size"] == 2 and read["nodes"] == 1 and read["step"] == 7
    assert [s["rank"] for s in read["shares"]] == [0, 1]
    assert read["optimizer"]["class"] == "HybridAdamW8bit"
    assert sc.read_manifest(tmp_path) is None


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """A gloo process group of one rank, so the save's collectives run in process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fake_accelerator(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                      dtype: str = "auto", max_shard_bytes: int = 50 * 10**9):
    plugin = SimpleNamespace(checkpoint_dtype=dtype, checkpoint_max_shard_bytes=max_shard_bytes)

    params = list(model.parameters())
    peers = SimpleNamespace(owns=lambda g: True)
    steps = SimpleNamespace(update_groups=_shares(params, 3), peers=peers, remote=None)
    engine = SimpleNamespace(steps=steps, masters_in_dram=lambda _: contextlib.nullcontext(),
                             pool=SimpleNamespace(received_views=dict))  # (no split layout)
    lazytrain = SimpleNamespace(engine=engine, model=model, optimizer=optimizer)
    return SimpleNamespace(lazytrain=lazytrain,
                           step=5, is_main_process=True, lazytrain_plugin=plugin)


def test_a_save_is_atomic_and_loads_back(tmp_path: Path, one_rank_group: None) -> None:
    model, optimizer = _trained(HybridAdamW8bit)
    accelerator = _fake_accelerator(model, optimizer)
    final = tmp_path / "ckpt"
    share_checkpoint.save_shares(accelerator, final,
                                 write_stock=lambda d: (d / "stock.txt").write_text("1"))
    assert sorted(p.name for p in final.iterdir()) == sorted(
        ["config.json", "model.safetensors", sc.MANIFEST, sc.share_file(0), "stock.txt"])
    before = sorted(p.name for p in tmp_path.iterdir())

    def failing(directory: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(RuntimeError, match=r"previous checkpoint .* kept: .*rank 0: OSError: "
                                           r"disk full"):
        share_checkpoint.save_shares(accelerator, final, write_stock=failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary left
    assert (final / "stock.txt").is_file()

    fresh = _model(seed=5)
    _into_one_storage(fresh)
    new = HybridAdamW8bit(fresh.parameters(), lr=1.0, backend="torch")
    share_checkpoint.load_shares(_fake_accelerator(fresh, new), final, sc.read_manifest(final))
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters(),
                                                 strict=True))
    assert _state_bytes(new, fresh).keys() == _state_bytes(optimizer, model).keys()


def test_automatic_naming_picks_the_next_folder_and_rotates(tmp_path: Path) -> None:

    config = SimpleNamespace(automatic_checkpoint_naming=True, total_limit=2)
    accelerator = SimpleNamespace(project_configuration=config, project_dir=str(tmp_path),
                                  save_iteration=3, is_main_process=True)
    for i in (0, 1, 2):
        (tmp_path / "checkpoints" / f"checkpoint_{i}").mkdir(parents=True)
    final = share_checkpoint.target_directory(accelerator, None)
    assert final == tmp_path / "checkpoints" / "checkpoint_3"
    assert len(list(final.parent.iterdir())) == 3  # nothing removed before the save
    final.mkdir()
    share_checkpoint.rotate(accelerator, final)
    assert sorted(p.name for p in final.parent.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    config.automatic_checkpoint_naming = False
    assert share_checkpoint.target_directory(accelerator, "x") == Path("x")
    with pytest.raises(ValueError, match="needs an output_dir"):
        share_checkpoint.target_directory(accelerator, None)


def test_the_weights_check_counts_every_element_of_the_written_files(tmp_path: Path) -> None:
    model = _model(tied=True)
    _into_one_storage(model)
    assert sc.saved_elements(tmp_path) is None  # nothing written: nothing to check
    sc.check_weights_complete(tmp_path, model)
    model.save_pretrained(tmp_path)  # the Trainer's save_model path, one storage
    expected = sum(t.numel() for _, t in sc.unique_state(model))
    assert sc.saved_elements(tmp_path) == expected
    sc.check_weights_complete(tmp_path, model)
    from safetensors.torch import save_file  # a de-duplicating writer kept one tensor
    save_file({"model.embed_tokens.weight": model.model.embed_tokens.weight.detach().clone()},
              tmp_path / sc.WEIGHTS)
    with pytest.raises(ValueError, match="weights were dropped"):
        sc.check_weights_complete(tmp_path, model)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / f"{sc.WEIGHTS}.index.json").is_file()
    assert sc.saved_elements(sharded) == expected


def test_the_trainer_resume_loads_the_shares_and_refuses_a_one_share_file(
        tmp_path: Path) -> None:
    model, optimizer = _trained(HybridAdamW8bit)
    _save(tmp_path / "ckpt", model, optimizer, 2)
    fresh = _model(seed=5)
    _into_one_storage(fresh)
    fresh.load_state_dict(model.state_dict())
    new = HybridAdamW8bit(fresh.parameters(), lr=1.0, backend="torch")
    accelerator = SimpleNamespace(lazytrain=SimpleNamespace(engine=None, model=fresh,
                                                            optimizer=new))
    share_checkpoint.load_optimizer_shares(accelerator, tmp_path / "ckpt",
                                           sc.read_manifest(tmp_path / "ckpt"), "optimizer.pt")
    saved, loaded = _state_bytes(optimizer, model), _state_bytes(new, fresh)
    assert saved.keys() == loaded.keys()  # both shares, re-sharded 2 -> 1
    assert all(torch.equal(v, loaded[k]) if isinstance(v, torch.Tensor) else v == loaded[k]
               for k, v in saved.items())
    # An optimizer.pt written by rank 0 of a store before share checkpoints: its share only
    params = list(model.parameters())
    state = optimizer.state_dict()
    first = set(range(len(params) // 2))
    (tmp_path / "old").mkdir()
    torch.save({**state, "state": {i: s for i, s in state["state"].items() if i in first}},
               tmp_path / "old" / "optimizer.pt")
    with pytest.raises(ValueError, match="one share only"):
        share_checkpoint.load_optimizer_shares(accelerator, tmp_path / "old", None, "optimizer.pt")
    with pytest.raises(FileNotFoundError, match="no optimizer state"):
        share_checkpoint.load_optimizer_shares(accelerator, tmp_path, None, "optimizer.pt")
    manifest = {**sc.read_manifest(tmp_path / "ckpt"), "optimizer": None}
    with pytest.raises(ValueError, match="save_only_model"):
        share_checkpoint.load_optimizer_shares(accelerator, tmp_path / "ckpt", manifest,
                                               "optimizer.pt")
