"""The CUDA path of multi-LoRA (sieve/lora/slots.py): every adapter's rows of a step in one pair of Triton launches per
projection, from adapters held in max_loras slots. Against the float64 product of each row's own adapter; rows of the
base model untouched; a row's result the same bits alone; adapters swapped into slots as steps change them. On this
CPU under Triton's interpreter; tests/test_cuda.py runs the same check compiled."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from test_attention_triton import needs_triton, run_interpreted

ARCH = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=96, num_layers=3,
                       is_mla=False, mamba_layers=(), sparse_layers=(), shared_expert_intermediate_size=0)


def _adapter(name: str, rank: int, modules: tuple[str, ...], seed: int):
    from sieve.lora.adapter import LoRAAdapter
    from sieve.lora.sites import dense_sites

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(ARCH.num_layers):
        for module in modules:
            inp, outs = dense_sites(ARCH)[module]
            r = rank * len(outs)
            weights[(layer, module)] = (torch.randn(inp, r, generator=g) * 0.2, torch.randn(r, sum(outs), generator=g) * 0.2)
    return LoRAAdapter(name, name, rank, f"fp-{name}", weights, modules=set(weights))


def _check_step(device, dtype, slots, groups, T):
    """Every projection of every layer through LoRABatch with `slots`, against float64."""
    from sieve.lora.sites import dense_sites
    from sieve.lora.batch import LoRABatch

    moved = [(_on(a, device, dtype), spans) for a, spans in groups]
    batch = LoRABatch(moved, torch.device(device), slots)
    g = torch.Generator().manual_seed(T)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for layer in range(ARCH.num_layers):
        for module, (inp, outs) in dense_sites(ARCH).items():
            x = torch.randn(T, inp, generator=g).to(device, dtype)
            y0 = torch.randn(T, sum(outs), generator=g).to(device, dtype)
            got = batch.apply(layer, module, x, y0.clone())
            want = y0.double().clone()
            for adapter, spans in moved:
                if (layer, module) in adapter.modules:
                    a, b = adapter.weights[(layer, module)]
                    for s, e in spans:
                        want[s:e] += (x[s:e].double() @ a.double()) @ b.double()
            assert (got.double() - want).abs().max() <= tol * (1 + want.abs().max()), (layer, module)
            covered = torch.zeros(T, dtype=torch.bool)
            for _, spans in moved:
                for s, e in spans:
                    covered[s:e] = True
            assert torch.equal(got[~covered.to(got.device)], y0[~covered.to(got.device)])  # the base rows: untouched
            s, e = moved[0][1][0]
            alone = LoRABatch([(moved[0][0], [(0, e - s)])], torch.device(device), slots)
            assert torch.equal(alone.apply(layer, module, x[s:e], y0[s:e].clone()), got[s:e])  # a row alone: same bits


def _on(adapter, device, dtype):
    adapter.weights = {k: (a.to(device, dtype), b.to(device, dtype)) for k, (a, b) in adapter.weights.items()}
    return adapter


def check_lora_slots(device: str) -> None:
    from sieve.lora.slots import LoRASlots

    for dtype in (torch.float32, torch.bfloat16):
        slots = LoRASlots(ARCH, 2, 16, dtype, torch.device(device))
        a = _adapter("a", 4, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), 1)
        b = _adapter("b", 16, ("qkv_proj",), 2)
        c = _adapter("c", 8, ("gate_up_proj", "down_proj"), 3)
        _check_step(device, dtype, slots, [(a, [(0, 3)]), (b, [(5, 9), (10, 11)])], 12)  # base rows between and after
        assert slots.num_loads == 2
        _check_step(device, dtype, slots, [(c, [(2, 6)]), (a, [(0, 2)])], 6)  # c takes b's slot; a stays where it is
        assert slots.num_loads == 3 and slots.resident.count("fp-b") == 0
        _check_step(device, dtype, slots, [(b, [(0, 1)]), (c, [(1, 4)])], 4)  # b back, in a's slot (used longest ago)
        assert slots.num_loads == 4 and set(slots.resident) == {"fp-b", "fp-c"}


@needs_triton
def test_multi_lora_kernels_under_the_interpreter():
    run_interpreted("test_lora_triton", "check_lora_slots")


def test_more_adapters_than_slots_in_a_step_is_refused():
    import pytest

    from sieve.lora.slots import LoRASlots

    slots = LoRASlots(ARCH, 1, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="over max_loras"):
        slots.assign([_adapter("a", 4, ("o_proj",), 1), _adapter("b", 4, ("o_proj",), 2)])
