"""The experts all at once (strata/model/grouped_experts.py, issue 53): torch's grouped product (bit
for bit on this CPU) and the padded batched products a GPU without the grouped kernel takes (fp64 to
1e-10, fp32 to 1e-5) against the per-expert loop, outputs and every gradient, uneven counts with
experts without rows, in one process and under ep 2; which form a call takes (the CUDA kernel's
conditions too, its capability stood in), counted; the host reads each makes."""

from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from strata.distributed.host_syncs import HostSyncs
from strata.model import grouped_experts as ge
from strata.model.moe import Experts, MoE
from strata.model.presets import get_preset
from strata.model.transformer import build_model

from distributed import run_on_ranks

SIZES = [5, 0, 17, 9, 0, 3]  # uneven, two experts without rows, 34 rows
# fp32 to the project's 1e-5, absolute as well: an element near zero of a 128-term sum carries the
# rounding of its largest terms (1.25e-6 on an AMD EPYC, where another kernel sums in another order)
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def _experts(n: int, d_model: int, d_ff: int, dtype: torch.dtype, seed: int = 0) -> Experts:
    experts = Experts(n, d_model, d_ff).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=dtype) * 0.2)
    return experts


def _outputs_and_gradients(experts: Experts, x: torch.Tensor, run) -> list[torch.Tensor]:
    """run(x, weights) -> y; y, and the gradients of x and the weights for a gradient of y that is
    not all ones (a sum's would be an expanded view: the grouped form's backward must take it)."""
    x = x.detach().requires_grad_()
    experts.zero_grad(set_to_none=True)
    y = run(x, (experts.w_gate, experts.w_up, experts.w_down))
    grad = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    y.backward(grad)
    return [y.detach(), x.grad, *(p.grad for p in (experts.w_gate, experts.w_up, experts.w_down))]


def _loop(sizes):
    return lambda x, weights: ge.loop_experts(x, sizes, *weights)


def _fake_grouped_mm(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """F.grouped_mm's semantics for a 2-d a and a 3-d b, in any dtype (the real one refuses fp64):
    group i is a's rows offs[i-1]:offs[i] times b[i]."""
    assert offs.dtype == torch.int32 and a.dim() == 2 and b.dim() == 3 and offs.numel() == b.shape[0]
    ends = offs.tolist()
    assert ends[-1] == a.shape[0]
    return torch.cat([a[start:end] @ b[i] for i, (start, end) in enumerate(zip([0, *ends[:-1]], ends))])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padded_products_equal_the_loop(dtype):
    """To rounding, not bit for bit: a product over 17 padded rows may take another kernel than one
    over 5 (here they differ by a few units in the last place)."""
    experts, counts = _experts(len(SIZES), 64, 128, dtype), torch.tensor(SIZES)
    x = torch.randn(sum(SIZES), 64, dtype=dtype, generator=torch.Generator().manual_seed(1))
    padded = _outputs_and_gradients(experts, x, lambda x, w: ge.padded_experts(x, counts, max(SIZES), *w))
    for got, want in zip(padded, _outputs_and_gradients(experts, x, _loop(SIZES))):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_torchs_grouped_product_equals_the_loop_bit_for_bit_in_fp32():
    """The real F.grouped_mm (on a CPU, torch's loop of products in C++): the offsets, the
    transposed weights and the backward's layout the CUDA kernel gets too."""
    experts, counts = _experts(len(SIZES), 64, 128, torch.float32), torch.tensor(SIZES)
    x = torch.randn(sum(SIZES), 64, generator=torch.Generator().manual_seed(1))
    assert ge.grouped_applies(x, experts.w_gate, experts.w_up, experts.w_down)
    grouped = _outputs_and_gradients(experts, x, lambda x, w: ge.grouped_experts(x, counts, *w))
    for got, want in zip(grouped, _outputs_and_gradients(experts, x, _loop(SIZES))):
        assert torch.equal(got, want)


def test_the_grouped_path_equals_the_loop_in_fp64_through_a_stand_in_product():
    experts, counts = _experts(len(SIZES), 64, 128, torch.float64), torch.tensor(SIZES)
    x = torch.randn(sum(SIZES), 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grouped = _outputs_and_gradients(experts, x, lambda x, w: ge.grouped_experts(x, counts, *w, _fake_grouped_mm))
    for got, want in zip(grouped, _outputs_and_gradients(experts, x, _loop(SIZES))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_under_autocast_the_grouped_product_multiplies_in_bf16_as_the_loop_does():
    experts, counts = _experts(len(SIZES), 64, 128, torch.float32), torch.tensor(SIZES)
    x = torch.randn(sum(SIZES), 64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ge.experts_path(x, (experts.w_gate, experts.w_up, experts.w_down), None) == "grouped"
        grouped = _outputs_and_gradients(experts, x, lambda x, w: ge.grouped_experts(x, counts, *w))
        loop = _outputs_and_gradients(experts, x, _loop(SIZES))
    assert grouped[0].dtype == loop[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grouped[1:])
    for got, want in zip(grouped, loop):
        assert torch.equal(got, want)


def test_which_form_a_call_takes():
    """On this CPU: the grouped product where it applies, else the loop. On a GPU where it does not
    apply: the padded products unless the padding more than doubles the rows."""
    n, weights32 = 4, tuple(_experts(4, 64, 128, torch.float32).parameters())
    weights64 = tuple(w.double() for w in weights32)
    x32, x64 = torch.randn(40, 64), torch.randn(40, 64, dtype=torch.float64)
    assert ge.experts_path(x32, weights32, None) == "grouped"  # torch's product on a CPU, fp32
    assert ge.experts_path(x64, weights64, [10] * n) == "loop"  # fp64: torch's product refuses it
    assert ge.experts_path(x32[:0], weights32, [0] * n) == "loop"  # no rows: no operand for the grouped backward
    narrow = tuple(_experts(4, 6, 128, torch.float32).parameters())  # 24-byte rows
    assert ge.experts_path(torch.randn(40, 6), narrow, [10] * n) == "loop"
    offset = torch.empty(n * 128 * 64 + 1)[1:].view(n, 128, 64)  # 4 bytes past a 16-byte boundary
    assert ge.experts_path(x32, (offset, *weights32[1:]), [10] * n) == "loop"
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0), shape=(40, 64))  # rows the grouped product refused
    assert ge.padded_applies(on_gpu, [10] * n)
    assert ge.padded_applies(on_gpu, [20, 20, 0, 0])  # padding doubles the rows: still
    assert not ge.padded_applies(on_gpu, [21, 19, 0, 0])  # more than double
    assert ge.padded_applies(SimpleNamespace(device=on_gpu.device, shape=(0, 64)), [0] * n)
    assert not ge.padded_applies(x64, [10] * n)  # on this CPU the loop is faster


def _forms_taken(run) -> dict[str, int]:
    """How many times each form ran while run() did (the forms Experts calls, counted)."""
    with ExitStack() as stack:
        calls = {name: stack.enter_context(mock.patch(f"strata.model.moe.{name}_experts",
                                                      wraps=getattr(ge, f"{name}_experts")))
                 for name in ("grouped", "padded", "loop")}
        run()
    return {name: call.call_count for name, call in calls.items() if call.call_count}


def test_experts_call_the_form_experts_path_names():
    def forms(experts, sizes, dtype):
        x = torch.randn(sum(sizes), 64, dtype=dtype)
        return _forms_taken(lambda: experts(x, torch.tensor(sizes)))

    for dtype, form in ((torch.float32, "grouped"), (torch.float64, "loop")):
        assert forms(_experts(len(SIZES), 64, 128, dtype), SIZES, dtype) == {form: 1}
    experts = _experts(6, 64, 128, torch.float64)
    with _forced("padded"):  # as on a GPU without the grouped kernel
        assert forms(experts, [9, 8, 8, 8, 0, 0], torch.float64) == {"padded": 1}
        assert forms(experts, [30, 1, 1, 1, 0, 0], torch.float64) == {"loop": 1}  # 6 x 30 padded rows for 33


@pytest.mark.parametrize("capability,dtype,groups,expected", [
    ((9, 0), torch.bfloat16, 8, True), ((10, 0), torch.bfloat16, 8, True),  # H100/H200, B200: the kernel
    ((8, 0), torch.bfloat16, 8, False),  # A100: torch would read the offsets on the host in every call
    ((9, 0), torch.float32, 8, False), ((9, 0), torch.float16, 8, False),  # the kernel is bf16's only
    ((9, 0), torch.bfloat16, 1024, False),  # past the kernel's groups
])
def test_on_cuda_the_grouped_product_runs_only_where_its_kernel_does(capability, dtype, groups, expected):
    with mock.patch.object(ge, "_cuda_capability", lambda index: capability):
        assert ge._grouped_kernel_here(torch.device("cuda", 0), dtype, groups) is expected


def _moe_layer(dtype: torch.dtype) -> MoE:
    cfg = get_preset("tiny-moe")
    model = build_model(cfg, dtype=dtype, seed=3)
    return model.blocks["0"].mlp


def _syncs_of_a_forward_and_backward(layer: MoE, x: torch.Tensor) -> dict:
    with HostSyncs() as syncs:
        layer(x).square().sum().backward()
    return dict(syncs.by_kind)


def test_the_grouped_product_reads_nothing_and_the_others_read_the_rows_once():
    """Counted host reads: the experts on their own (given no sizes), and a dropless MoE layer's
    forward and backward, in one process: none in fp32 (the grouped product), one in fp64 (the
    loop; the padded products likewise)."""
    counts = torch.tensor(SIZES)
    for dtype, form, reads in ((torch.float32, None, {}), (torch.float64, None, {"tolist": 1}),
                               (torch.float64, "padded", {"tolist": 1})):
        with _forced(form):
            experts = _experts(len(SIZES), 64, 128, dtype)
            x = torch.randn(sum(SIZES), 64, dtype=dtype)
            with HostSyncs() as syncs:
                experts(x, counts).sum().backward()
            assert dict(syncs.by_kind) == reads, (dtype, form)
            with HostSyncs() as syncs:
                experts(x, counts, SIZES).sum().backward()  # the caller's read: none here
            assert dict(syncs.by_kind) == {}, (dtype, form)
            layer = _moe_layer(dtype)
            layer.train()
            x = torch.randn(2, 31, 64, dtype=dtype, generator=torch.Generator().manual_seed(2))
            assert _syncs_of_a_forward_and_backward(layer, x) == reads, (dtype, form)


def _forced(form: str | None) -> ExitStack:
    """Every Experts call through `form`: 'loop' (the form before issue 53's change, and this CPU's
    for fp64), 'padded' (a GPU's without the grouped kernel: the padded products, on this CPU,
    wherever the padding fits), None (as chosen)."""
    stack = ExitStack()
    if form is not None:
        stack.enter_context(mock.patch("strata.model.moe.grouped_applies", lambda *args: False))
        fits = (lambda x, sizes: ge.padding_fits(sizes, x.shape[0])) if form == "padded" else (lambda *args: False)
        stack.enter_context(mock.patch("strata.model.moe.padded_applies", fits))
    return stack


def _loss_and_gradients(model, tokens) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("dtype,form", [(torch.float64, "padded"), (torch.float32, None), (torch.float32, "padded")])
def test_a_model_step_equals_the_loops_in_one_process(dtype, form):
    model = build_model(get_preset("tiny-moe"), dtype=dtype, seed=5)
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    with _forced(form):
        taken = _forms_taken(lambda: _loss_and_gradients(model, tokens))
        new = _loss_and_gradients(model, tokens)
    assert taken == {form or "grouped": get_preset("tiny-moe").n_layers}
    with _forced("loop"):
        old = _loss_and_gradients(model, tokens)
    for got, want in zip(new, old):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])


class _Skewed(torch.nn.Module):
    """A router whose logits follow the token but never pick expert 3 (rank 1's second of ep 2):
    uneven counts, and an expert with no rows from any rank."""

    def forward(self, x):
        return 3 * x[:, :4] + torch.tensor([0.0, 0.0, 0.0, -50.0], dtype=x.dtype)


def _ep2_new_and_loop(dtype_name: str, form: str | None):
    import torch.distributed as dist

    from strata.distributed.mesh import ParallelDims, expert_axes
    from strata.parallel.expert import ExpertAxes, apply_expert_parallel
    rank, dtype = dist.get_rank(), getattr(torch, dtype_name)
    model = build_model(get_preset("tiny-moe"), seed=None)
    apply_expert_parallel(model, ExpertAxes(*expert_axes(ParallelDims(dp=2), 2, rank, 30)))
    model = model.to_empty(device="cpu")
    model.init_weights(0)
    model = model.to(dtype)
    for name, module in list(model.named_modules()):
        if name.endswith("mlp.router"):
            model.get_submodule(name.rsplit(".", 1)[0]).router = _Skewed()
    tokens = torch.randint(0, 256, (2, 31), generator=torch.Generator().manual_seed(rank))
    with _forced(form):
        taken = _forms_taken(lambda: _loss_and_gradients(model, tokens))
        new = _loss_and_gradients(model, tokens)
    with _forced("loop"):
        old = _loss_and_gradients(model, tokens)
    return new, old, taken


@pytest.mark.parametrize("dtype,form", [("float64", "padded"), ("float32", None)])
def test_under_expert_parallelism_the_experts_equal_the_loop(dtype, form):
    for new, old, taken in run_on_ranks(_ep2_new_and_loop, 2, dtype, form, timeout=180):
        assert taken == {form or "grouped": get_preset("tiny-moe").n_layers}
        for got, want in zip(new, old):
            torch.testing.assert_close(got, want, **TOLERANCE[getattr(torch, dtype)])
