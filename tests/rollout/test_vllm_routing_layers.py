"""vLLM's captured routing, numbered by decoder layer, read at conveyor's sparse MoE layers.

vLLM returns routed experts only on CUDA; these tests check the layer arithmetic on the layouts it returns
(tokens, decoder layers, K), with the sparse layers taken from real tiny models.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.models.moe_routing import moe_layers, sparse_decoder_layers
from conveyor.models.tiny import tiny_config
from conveyor.rollout.vllm import select_sparse_layers


def _model(**overrides) -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", vocab_size=32, num_layers=4, **overrides))


def test_dense_layers_are_left_out_of_the_sparse_layer_indices() -> None:
    assert sparse_decoder_layers(_model()) == [0, 1, 2, 3]
    model = _model(mlp_only_layers=[0, 2])  # Qwen3-MoE's dense layers
    assert sparse_decoder_layers(model) == [1, 3]
    assert len(moe_layers(model)) == 2


def test_vllm_routing_of_every_decoder_layer_is_read_at_the_sparse_ones() -> None:
    tokens, k = 5, 2
    per_layer = torch.arange(4)[None, :, None].expand(tokens, 4, k)  # row l holds l: which layer was read
    got = select_sparse_layers(per_layer, sparse_decoder_layers(_model(mlp_only_layers=[0, 2])))
    assert got.shape == (tokens, 2, k) and got[:, :, 0].unique().tolist() == [1, 3]
    # Every layer sparse (or no layer list): the routing as returned.
    assert select_sparse_layers(per_layer, [0, 1, 2, 3]) is per_layer
    assert select_sparse_layers(per_layer, None) is per_layer
    with pytest.raises(ValueError, match="4 decoder layers"):
        select_sparse_layers(per_layer, [1, 5])
