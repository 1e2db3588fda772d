"""Long context (issue 23): the working set's terms by hand, the tile decision, refusals
naming the term left over, and the sequence search."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain_accel.planning import Budgets, PlanInfeasibleError, make_plan
from lazytrain_accel.planning.admission import _largest, max_seq_len
from lazytrain_accel.planning.request import PlanRequest
from lazytrain_accel.profiling.hardware import HARDWARE_PRESETS
from lazytrain_accel.profiling.model_configs import (
    geometry_from_config,
    load_model_config,
    profile_model,
)
from lazytrain_accel.profiling.profile import ModelGeometry
from lazytrain_accel.profiling.working_set import (
    ATTENTION_TERM,
    TILED_BOUNDARY_TERM,
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
    seq_tiled = layer_working_set(SMALL, batch_size=1, seq_len=256, bytes_per_elem=2,
                                  weights=None, tile_tokens=32, attention_block_tokens=64)
    assert seq_tiled.sequence_tiled
    # The whole layer in tiles of 64 positions (`engine/sequence/layer_tiles.py`): K, V bf16 + fp32
    # dK, dV accumulators + bf16 dK, dV partials of the key prefix, for all 256 keys; one
    # tile's query side (q, o, dO, dQ, fp32 dQ accumulator, logsumexp) for 64.
    assert seq_tiled.attention_bytes == 256 * 32 * (4 + 8 + 4) + 64 * (512 + 256 + 16)
    # one tile's: its MLP in tiles of 32, its dOut, dx, mid residual and norms for 64
    assert seq_tiled.token_wise_bytes == (32 * 6 * 128 * 2
                                          + 64 * (3 * 64 * 2 + 2 * (2 * 64 * 2 + 64 * 4)))
    # one [S, h] gradient: dx overwrites dOut tile by tile
    assert seq_tiled.boundary_bytes == 256 * 64 * 2
    assert seq_tiled.weight_grad_bytes == 1000 * (4 + 2)  # fp32 sum + one tile's bf16
    assert TILED_BOUNDARY_TERM in dict(seq_tiled.terms())
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
    assert (roomy.tiling, roomy.tile_tokens) == ("none", 0)
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
    assert plan.tiling == "layer" and plan.tile_tokens > 0
    assert plan.prediction.peak_gpu_bytes <= H200.gpu_memory_bytes
    assert plan.prediction.peak_cpu_bytes <= H200.cpu_memory_bytes
    assert plan.solver.solve_s < 5


@pytest.mark.parametrize(("seq_len", "tile", "hardware", "term"), [
    (524288, 0, "h200", TOKEN_WISE_TERM), (1_500_000, None, "a100-80g", ATTENTION_TERM)])
def test_refusals_name_the_term_left_over(seq_len: int, tile: int | None, hardware: str,
                                          term: str) -> None:
    with pytest.raises(PlanInfeasibleError) as err:
        make_plan(_llama(seq_len, tile), HARDWARE_PRESETS[hardware],
                  PlanRequest(time_limit_s=20, diagnose_s=1))
    text = str(err.value)
    assert f"largest term is {term}" in text and "--seq-len" in text


def test_2m_tokens_plan_on_one_h200_with_the_hidden_state_past_2_31() -> None:
    plan = make_plan(_llama(2_000_000, None), H200, PlanRequest(time_limit_s=20))
    assert plan.tiling == "layer"  # the whole layer in sequence tiles
    assert 2_000_000 * 4096 >= 2**31  # [S, hidden] past int32 indexing: the tiles chunk it
    assert plan.prediction.peak_gpu_bytes <= H200.gpu_memory_bytes


def test_k_and_v_past_2_31_are_refused_by_name() -> None:
    with pytest.raises(PlanInfeasibleError, match=r"K and V .*at or past 2\^31"):
        make_plan(_llama(2_500_000, None), H200, PlanRequest(time_limit_s=20))


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
