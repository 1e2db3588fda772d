"""The gradient sink's taker (`GradSink.taker`, issue 45): a split update's reduce takes a
layer's landed gradients before they become `.grad`, reading them in the pinned staging
until its send is done; the slot is reused only then, and a landed copy is handed over as
soon as it has completed, so the send has a layer's backward to run."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from torch import nn

from lazytrain_accel.engine.device.emulation import EmulatedStreams, EmulationSettings
from lazytrain_accel.engine.memory.grads import GradSink
from lazytrain_accel.engine.stats import Accounting


def _sink() -> tuple[GradSink, list[list[nn.Parameter]]]:
    streams = EmulatedStreams(torch.device("cpu"), EmulationSettings(seed=3, jitter_s=0.0))
    layers = [[nn.Parameter(torch.zeros(4, 4))] for _ in range(3)]
    return GradSink(streams=streams, accounting=Accounting(), max_numel=16,
                    grad_dtype=torch.float32), layers


def test_a_landed_copy_is_handed_to_the_taker_at_the_next_layers_put() -> None:
    """Not when its slot is needed again (the fold's time without a taker): then the
    send would have no time to run before the backward waits for it."""
    sink, layers = _sink()
    taken: list[int] = []

    def taker(params: list[nn.Parameter], grads: list[torch.Tensor]) -> Future[None]:
        taken.append(next(i for i, layer in enumerate(layers) if layer[0] is params[0]))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    sink.taker = taker
    sink.put(layers[2], [torch.full((4, 4), 3.0)])  # slot 0
    for _, _, event in sink._pending:
        event.synchronize()  # its copy has landed
    sink.put(layers[1], [torch.full((4, 4), 2.0)])  # slot 1
    assert taken == [2]
    sink.drain()
    assert taken == [2, 1]


def test_the_slot_of_a_taken_layer_is_reused_only_once_its_send_is_done() -> None:
    sink, layers = _sink()
    sends: dict[int, Future[None]] = {}
    seen: dict[int, torch.Tensor] = {}

    def taker(params: list[nn.Parameter], grads: list[torch.Tensor]) -> Future[None]:
        j = next(i for i, layer in enumerate(layers) if layer[0] is params[0])
        seen[j] = grads[0].clone()
        sends[j] = Future()
        return sends[j]

    sink.taker = taker
    sink.put(layers[2], [torch.full((4, 4), 3.0)])  # slot 0
    sink.put(layers[1], [torch.full((4, 4), 2.0)])  # slot 1
    reused = threading.Thread(target=sink.put, args=(layers[0], [torch.full((4, 4), 1.0)]))
    reused.start()  # slot 0: layer 2's send still reads it
    reused.join(timeout=0.5)
    assert reused.is_alive()  # waiting for the send
    assert 2 in seen and torch.equal(seen[2], torch.full((4, 4), 3.0))
    sends[2].set_result(None)
    reused.join(timeout=10)
    assert not reused.is_alive()
    sends[1].set_result(None)
    sink.drain()
    sends[0].set_result(None)
    assert all(p.grad is None for layer in layers for p in layer)  # taken: never `.grad`
    assert [torch.equal(seen[j], torch.full((4, 4), j + 1.0)) for j in range(3)] == [True] * 3


def test_a_send_that_failed_is_raised_where_its_slot_is_reused() -> None:
    sink, layers = _sink()

    def taker(params: list[nn.Parameter], grads: list[torch.Tensor]) -> Future[None]:
        failed: Future[None] = Future()
        failed.set_exception(RuntimeError("rank 1 died mid-step"))
        return failed

    sink.taker = taker
    sink.put(layers[2], [torch.ones(4, 4)])
    sink.put(layers[1], [torch.ones(4, 4)])
    with pytest.raises(RuntimeError, match="rank 1 died mid-step"):
        sink.put(layers[0], [torch.ones(4, 4)])


def test_a_declining_taker_leaves_the_fold_as_it_was() -> None:
    sink, layers = _sink()
    ready: list[list[nn.Parameter]] = []
    sink.taker = lambda params, grads: None
    sink.ready_hooks.append(ready.append)
    for j in (2, 1, 0):
        sink.put(layers[j], [torch.full((4, 4), j + 1.0)])
    sink.drain()
    assert [r[0] is layers[j][0] for r, j in zip(ready, (2, 1, 0), strict=True)] == [True] * 3
    assert all(torch.equal(layers[j][0].grad, torch.full((4, 4), j + 1.0)) for j in range(3))
