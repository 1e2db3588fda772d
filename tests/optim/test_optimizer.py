"""HybridAdamW8bit as a torch optimizer: per-layer steps, groups, schedulers, state."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from lazytrain_accel.optim import HybridAdamW8bit

from .helpers import assert_states_equal, clone_params, make_params, set_random_grads


def test_layerwise_steps_on_a_thread_equal_one_step() -> None:
    whole, layered = make_params(), make_params()
    a = HybridAdamW8bit(whole, lr=1e-2, max_grad_norm=0.5)
    b = HybridAdamW8bit(layered, lr=1e-2, max_grad_norm=0.5)
    for step in range(3):
        set_random_grads(whole, seed=step)
        set_random_grads(layered, seed=step)
        a.step()
        assert b.begin_step()
        layers = [[layered[2]], [layered[0], layered[3]], [layered[1]]]
        worker = threading.Thread(target=_step_layers, args=(b, layers))
        worker.start()
        worker.join()
        b.end_step()
    assert_states_equal(a, b)


def _step_layers(opt: HybridAdamW8bit, layers: list[list[torch.nn.Parameter]]) -> None:
    for layer in layers:
        opt.step_params(layer)


def test_state_is_8bit_codes_for_large_tensors_and_fp32_for_small_ones() -> None:
    big, small = torch.nn.Parameter(torch.randn(1024, 512)), torch.nn.Parameter(torch.randn(64))
    opt = HybridAdamW8bit([big, small], block_size=256)
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    opt.step()
    assert sorted(opt.state[big]) == [
        "exp_avg_absmax", "exp_avg_codes", "exp_avg_sq_absmax", "exp_avg_sq_codes", "step"]
    assert opt.state[big]["exp_avg_codes"].dtype == torch.uint8
    assert sorted(opt.state[small]) == ["exp_avg", "exp_avg_sq", "step"]
    big_bytes = sum(v.numel() * v.element_size() for k, v in opt.state[big].items() if k != "step")
    assert big_bytes / big.numel() == pytest.approx(2 + 8 / 256)


def _twin_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    twin.load_state_dict(model.state_dict())
    return model, twin


def _groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": model[0].parameters(), "lr": 2e-2, "weight_decay": 0.1},
            {"params": model[2].parameters(), "weight_decay": 0.0}]


def test_fp32_state_path_follows_torch_adamw_with_groups_and_scheduler() -> None:
    model, twin = _twin_models()
    ours = HybridAdamW8bit(_groups(model), lr=1e-2, min_8bit_numel=10**9)
    torch_opt = torch.optim.AdamW(_groups(twin), lr=1e-2)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
                 for o in (ours, torch_opt)]
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    for _ in range(10):
        for net, opt in ((model, ours), (twin, torch_opt)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        for schedule in schedules:
            schedule.step()
    assert ours.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"] == 2e-2 * 0.125
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _train(params: list[torch.nn.Parameter], opt: HybridAdamW8bit, steps: range) -> None:
    for step in steps:
        set_random_grads(params, seed=100 + step)
        opt.step()


def test_state_dict_round_trip_mid_training_reproduces_the_trajectory() -> None:
    params = make_params()
    opt = HybridAdamW8bit(params, lr=1e-2, max_grad_norm=1.0)
    _train(params, opt, range(3))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optim": opt.state_dict()}, buffer)
    _train(params, opt, range(3, 6))

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    opt2 = HybridAdamW8bit(resumed, lr=123.0, max_grad_norm=1.0)  # lr comes from the dict
    opt2.load_state_dict(saved["optim"])
    assert opt2.state[resumed[0]]["exp_avg_codes"].dtype == torch.uint8
    _train(resumed, opt2, range(3, 6))
    assert_states_equal(opt, opt2)


def test_state_dict_loads_in_another_process(tmp_path: Path) -> None:
    params = make_params()
    opt = HybridAdamW8bit(params, lr=1e-2)
    _train(params, opt, range(2))
    torch.save({"params": [p.detach() for p in params], "optim": opt.state_dict()},
               tmp_path / "ckpt.pt")
    _train(params, opt, range(2, 4))
    script = (
        "import sys, torch\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from helpers import set_random_grads\n"
        "from lazytrain_accel.optim import HybridAdamW8bit\n"
        "ckpt = torch.load(sys.argv[1] + '/ckpt.pt')\n"
        "ps = [torch.nn.Parameter(t) for t in ckpt['params']]\n"
        "opt = HybridAdamW8bit(ps)\n"
        "opt.load_state_dict(ckpt['optim'])\n"
        "for step in range(2, 4):\n"
        "    set_random_grads(ps, seed=100 + step)\n"
        "    opt.step()\n"
        "torch.save([p.detach() for p in ps], sys.argv[1] + '/out.pt')\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path), str(Path(__file__).parent)],
                   check=True, timeout=120)
    for p, q in zip(params, torch.load(tmp_path / "out.pt"), strict=True):
        assert torch.equal(p.detach(), q)


def test_loading_with_another_block_size_or_model_is_refused() -> None:
    params = make_params()
    opt = HybridAdamW8bit(params, block_size=128)
    set_random_grads(params, seed=0)
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0]["block_size"] = 256  # as if saved by a run with block 256
    with pytest.raises(ValueError, match="blocks, expected"):
        HybridAdamW8bit(clone_params(params), block_size=128).load_state_dict(saved)
    other = [torch.nn.Parameter(torch.randn(p.numel() + 1)) for p in params]
    with pytest.raises(ValueError, match="different model"):
        HybridAdamW8bit(other, block_size=128).load_state_dict(opt.state_dict())


def test_protocol_misuse_and_bad_arguments_raise_clear_errors() -> None:
    params = make_params()
    opt = HybridAdamW8bit(params)
    set_random_grads(params, seed=0)
    with pytest.raises(RuntimeError, match="call begin_step"):
        opt.step_params(params)
    assert opt.begin_step()
    with pytest.raises(RuntimeError, match="before end_step"):
        opt.begin_step()
    opt.step_params(params[:1])
    with pytest.raises(RuntimeError, match="already updated"):
        opt.step_params(params[:1])
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.step_params([_with_grad(torch.nn.Parameter(torch.ones(2)))])
    opt.end_step()
    with pytest.raises(ValueError, match="fp32 master"):
        HybridAdamW8bit([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="block_size"):
        HybridAdamW8bit(make_params(), block_size=0)
    with pytest.raises(ValueError, match="betas"):
        HybridAdamW8bit(make_params(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="max_grad_norm"):
        HybridAdamW8bit(make_params(), max_grad_norm=0.0)


def _with_grad(param: torch.nn.Parameter) -> torch.nn.Parameter:
    param.grad = torch.ones_like(param)
    return param


def test_without_a_kernel_auto_falls_back_and_native_refuses(monkeypatch) -> None:
    from lazytrain_accel.optim import native

    monkeypatch.setattr(native, "load_kernel", lambda: None)
    params = make_params()
    opt = HybridAdamW8bit(params, backend="auto")
    assert not opt.uses_native_kernel
    set_random_grads(params, seed=0)
    opt.step()
    assert int(opt.state[params[0]]["step"]) == 1
    with pytest.raises(RuntimeError, match="could not be built"):
        HybridAdamW8bit(make_params(), backend="native")


def test_a_failed_build_warns_and_returns_none(monkeypatch, caplog) -> None:
    import torch.utils.cpp_extension

    from lazytrain_accel.optim import native

    def broken_load(**kwargs):
        raise OSError("no compiler here\nsecond line")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken_load)
    monkeypatch.setattr(native, "_LOADED", {})  # as in a process that loaded none yet
    with caplog.at_level("WARNING"):
        assert native.load_kernel.__wrapped__() is None
    assert "OSError: no compiler here" in caplog.text and "pure-torch" in caplog.text
