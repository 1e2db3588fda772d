"""Long context (issue 23): the working set's terms by hand, the tile decision, refusals
naming the term left over, and the sequence search."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain_accel.planning import Budgets, PlanInfeasibleError, make_plan
from lazytrain_accel.planning.admission import _largest, max_seq_len
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model import ModelGeometry
from lazytrain_accel.profiling.models import geometry_from_config, load_model_config, profile_model
from lazytrain_accel.profiling.working_set import (
    BOUNDARY_TERM,
    TOKEN_WISE_TERM,
    extra_launches,
    layer_working_set,
)

GIB = 2**30
H200 = HARDWARE_PRESETS["h200"]
SMALL = ModelGeometry(name="small", family="llama", num_layers=2, hidden_size=64,
                      intermediate_size=128, num_attention_heads=4, num_kv_heads=2,
                      head_dim=16, vocab_size=100, tied_embeddings=True, layer_param_count=1000,
                      embedding_param_count=6400, head_param_count=0,
                      final_norm_param_count=64)


def _llama(seq_len: int, tile_tokens: int | None):
    geometry = geometry_from_config(load_model_config("llama3-8b"), name="llama3-8b")
    return profile_model(geometry, batch_size=1, seq_len=seq_len, loss_chunk_tokens=None,
                         tile_tokens=tile_tokens)


def test_terms_by_hand_for_a_small_geometry() -> None:
    # h = 64, q = 4 x 16 = 64, kv = 2 x 16 = 32, I = 128, bf16, 256 tokens.
    whole = layer_working_set(SMALL, batch_size=1, seq_len=256, bytes_per_elem=2, weights=None)
    # q, o, dO, dQ (4 x 64 x 2) + k, v, dK, dV (4 x 32 x 2) + fp32 dQ acc (4 x 64) + lse (4 x 4)
    assert whole.attention_bytes == 256 * (512 + 256 + 256 + 16)
    # gate, up, act, product + 2 transient grads (6 x 128), bf16
    assert whole.token_wise_bytes == 256 * 6 * 128 * 2
    # dOut, dx, mid residual (3 x 64 x 2) + 2 norms x (normalized, output bf16, fp32 input)
    assert whole.boundary_bytes == 256 * (3 * 64 * 2 + 2 * (2 * 64 * 2 + 64 * 4))
    assert whole.weight_grad_bytes == 1000 * 2
    assert whole.total_bytes == sum(b for _, b in whole.terms())
    tiled = layer_working_set(SMALL, batch_size=1, seq_len=256, bytes_per_elem=2, weights=None,
                              tile_tokens=64)
    assert tiled.token_wise_bytes == 64 * 6 * 128 * 2
    assert tiled.attention_bytes == whole.attention_bytes
    blocked = layer_working_set(SMALL, batch_size=1, seq_len=256, bytes_per_elem=2,
                                weights=None, tile_tokens=64, attention_block_tokens=64)
    # q, o, dO, dQ for all 256 tokens (the layer's projections make and take them whole);
    # K, V bf16 + fp32 dK, dV + bf16 partials for all 256 keys; the SDPA backward's own
    # query side (block output and dQ, fp32 dQ accumulator, logsumexp) for 64.
    assert blocked.attention_bytes == (256 * (4 * 64 * 2) + 256 * 32 * (4 + 8 + 4)
                                       + 64 * (512 + 256 + 16))
    assert blocked.boundary_bytes == whole.boundary_bytes  # dx is a new [S, h] tensor
    assert blocked.token_wise_bytes == tiled.token_wise_bytes
    assert extra_launches(batch_size=1, seq_len=256, tile_tokens=64,
                          attention_block_tokens=64) == 3 + 3


def test_8b_per_token_figures_match_the_design_estimates() -> None:
    g = geometry_from_config(load_model_config("llama3-8b"), name="llama3-8b")
    ws = layer_working_set(g, batch_size=1, seq_len=1, bytes_per_elem=2, weights=None)
    assert ws.attention_bytes == (4 * 8 + 4 * 2 + 16) * 1024 + 32 * 4  # ~56 KiB
    assert ws.token_wise_bytes == 6 * 28 * 1024  # 6 x [S, 14336]
    assert ws.boundary_bytes == 3 * 8 * 1024 + 2 * (2 * 8 + 16) * 1024  # 88 KiB


def test_untiled_when_it_fits_tiled_only_when_it_does_not() -> None:
    roomy = make_plan(_llama(131072, None), H200, PlanRequest(time_limit_s=20))
    assert (roomy.tile_tokens, roomy.attention_block_tokens) == (0, 0)
    tight = Budgets(gpu_bytes=40 * GIB, cpu_bytes=H200.cpu_memory_bytes, nvme_bytes=0)
    with pytest.raises(PlanInfeasibleError):
        make_plan(_llama(131072, 0), H200,
                  PlanRequest(budgets=tight, time_limit_s=20, diagnose_s=0))
    tiled = make_plan(_llama(131072, None), H200, PlanRequest(budgets=tight, time_limit_s=20))
    assert tiled.tile_tokens > 0
    assert tiled.prediction.peak_gpu_bytes <= tight.gpu_bytes
    assert tiled.prediction.step_s >= roomy.prediction.step_s  # tiles only cost time here


def test_750k_tokens_plan_on_one_h200_in_query_blocks() -> None:
    plan = make_plan(_llama(750_000, None), H200, PlanRequest(time_limit_s=20))
    assert plan.tile_tokens > 0 and plan.attention_block_tokens > 0
    assert plan.prediction.peak_gpu_bytes <= H200.gpu_memory_bytes
    assert plan.prediction.peak_cpu_bytes <= H200.cpu_memory_bytes
    assert plan.solver.solve_s < 5


@pytest.mark.parametrize(("seq_len", "tile", "term"), [(524288, 0, TOKEN_WISE_TERM),
                                                       (2_500_000, None, BOUNDARY_TERM)])
def test_refusals_name_the_term_left_over(seq_len: int, tile: int | None, term: str) -> None:
    with pytest.raises(PlanInfeasibleError) as err:
        make_plan(_llama(seq_len, tile), H200, PlanRequest(time_limit_s=20, diagnose_s=1))
    text = str(err.value)
    assert f"largest term is {term}" in text and "--seq-len" in text


@pytest.mark.parametrize("edge", [1, 2, 3, 7, 8, 9, 100, 1023, 1024])
def test_the_search_finds_every_edge(edge: int) -> None:
    probes: list[int] = []

    def fits(n: int) -> bool:
        probes.append(n)
        return n <= edge

    assert _largest(fits, 1024) == edge
    assert len(probes) <= 2 * 11 + 1


def test_max_seq_is_the_feasibility_edge() -> None:
    budgets = Budgets(gpu_bytes=30 * GIB, cpu_bytes=H200.cpu_memory_bytes, nvme_bytes=0)
    request = PlanRequest(budgets=budgets, time_limit_s=20)
    best = max_seq_len(lambda s: _llama(s, None), H200, request, step_tokens=65536,
                       limit_tokens=1 << 22)
    assert 65536 <= best < 1 << 22
    make_plan(_llama(best, None), H200, request)
    with pytest.raises(PlanInfeasibleError):
        make_plan(_llama(best + 65536, None), H200, dataclasses.replace(request, diagnose_s=0))
    wider = Budgets(gpu_bytes=40 * GIB, cpu_bytes=H200.cpu_memory_bytes, nvme_bytes=0)
    assert max_seq_len(lambda s: _llama(s, None), H200,
                       PlanRequest(budgets=wider, time_limit_s=20), step_tokens=65536,
                       limit_tokens=1 << 22) >= best
