"""The layers compute with PyTorch ops until they choose, once, what serves their device and
dtype; every choice gives Hugging Face's numbers (bit for bit, or within the kernels' roundings)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.layers import bind_attributes, choose_impls
from pagedllm.layers.activation import SiluAndMul, silu_and_mul_torch
from pagedllm.layers.layernorm import RMSNorm, add_rms_norm_float32, add_rms_norm_torch
from pagedllm.layers.linear import Linear, MergedColumnParallelLinear, cpu_linear, onednn_linear

CPU = torch.device("cpu")


def _norm_and_activation(dtype: torch.dtype) -> torch.nn.Sequential:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64, generator=gen)
    return torch.nn.Sequential(norm, SiluAndMul()).to(dtype)


def test_layers_use_pytorch_ops_until_they_choose():
    norm, act = _norm_and_activation(torch.float32)
    assert norm.impl is add_rms_norm_torch and act.impl is silu_and_mul_torch
    assert Linear(64, 32).impl is F.linear


def test_off_cpu_float32_norm_takes_the_fused_op_bit_for_bit():
    norm, act = _norm_and_activation(torch.float32)
    choose_impls(torch.nn.Sequential(norm, act), torch.device("meta"), torch.float32)
    assert norm.impl is add_rms_norm_float32 and act.impl is silu_and_mul_torch
    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(2, 5, 64, generator=gen)
    for got, want in zip(norm(x, residual), add_rms_norm_torch(x, residual, norm.weight, 1e-5), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cpu_the_norm_and_activation_choose_the_cpp_passes(dtype):
    if not cpu_ops.is_built():
        pytest.skip("no CPU kernel build")
    layers = _norm_and_activation(dtype)
    norm, act = layers
    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(2, 7, 64, generator=gen).to(dtype)
    gate_up = torch.randn(7, 128, generator=gen).to(dtype)
    want_norm, want_act = norm(x, residual), act(gate_up)
    choose_impls(layers, CPU, dtype)
    assert norm.impl is cpu_ops.add_rms_norm and act.impl is cpu_ops.silu_and_mul
    got_norm = norm(x, residual)
    assert torch.equal(got_norm[1], want_norm[1])  # the residual sum, bit for bit
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got_norm[0], want_norm[0], **tolerance)
    torch.testing.assert_close(act(gate_up), want_act, **tolerance)


@pytest.mark.parametrize("rows", [1, 200])
def test_on_cpu_a_projection_packs_its_weight_once_and_answers_as_before(rows, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))  # its timings: layers/test_linear_dispatch.py
    gen = torch.Generator().manual_seed(3)
    layer = Linear(64, 48, bias=True)
    x = torch.randn(rows, 64, generator=gen)
    want = F.linear(x, layer.weight, layer.bias).detach()
    layer.choose_impl(CPU, torch.float32)
    assert layer.impl in (
        cpu_ops.few_rows_linear,
        onednn_linear,
        cpu_linear,
    )
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_a_merged_projection_places_each_checkpoint_tensor_at_its_rows():
    layer = MergedColumnParallelLinear(4, [6, 2, 2], bias=False, tp=None)
    parts = [torch.full((n, 4), float(i)) for i, n in enumerate([6, 2, 2])]
    for shard_id in (2, 0, 1):  # any order
        layer.weight_loader(layer.weight, parts[shard_id], shard_id)
    assert torch.equal(layer.weight.data, torch.cat(parts))
    with pytest.raises(ValueError, match="shape"):
        layer.weight_loader(layer.weight, torch.zeros(3, 4), 1)


def test_bound_attributes_read_as_the_module_holds_them_and_follow_reassignment():
    model = torch.nn.Sequential(MergedColumnParallelLinear(64, [32, 32], False, None), SiluAndMul())
    before = {name: t.clone() for name, t in model.state_dict().items()}
    bind_attributes(model)
    proj = model[0]
    assert proj.__dict__["weight"] is proj._parameters["weight"] and model.__dict__["0"] is proj
    assert proj.bias is None and list(model.state_dict()) == list(before)
    x = torch.randn(3, 64)
    gate, up = F.linear(x, before["0.weight"]).chunk(2, dim=-1)
    assert torch.equal(model(x), F.silu(gate) * up)
    proj.weight = torch.nn.Parameter(torch.zeros(64, 64))  # reassigned: the new one is read
    assert proj.weight is proj._parameters["weight"] and torch.equal(model(x), torch.zeros(3, 32))
    model[1] = torch.nn.Identity()  # likewise a submodule
    assert isinstance(model[1], torch.nn.Identity) and torch.equal(model(x), torch.zeros(3, 64))
