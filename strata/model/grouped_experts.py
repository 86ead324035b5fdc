"""The experts' matrix products, all experts at once (issue 53): rows sorted by expert, counts[i] of
them for expert i, through n SwiGLU experts whose weights are stacked (n, out, in).

Three forms of the same arithmetic (on a CPU the grouped form equals the loop bit for bit, the
padded one to rounding, a product's kernel depending on its row count: tests/test_grouped_experts.py):
  grouped  torch's grouped matrix product (F.grouped_mm), its groups delimited by offsets computed
           on the device from the counts: on a GPU where it has its kernel (bf16 on compute
           capability 9.x or 10.x) it reads nothing on the host; on a CPU (fp32, bf16, fp16) it is
           a loop of products in C++. Elsewhere (fp32 on a GPU, an sm80 GPU) torch would read the
           offsets on the host in every call, forward and backward, so it is not used there.
  padded   on a GPU without that kernel: each expert's rows scattered into a zero-padded
           (n, longest, d) block and three batched products (torch.bmm), one launch each whatever
           the experts; one read of the rows per expert (the longest, from the counts as a list,
           which the layer reads once anyway).
  loop     one product per expert, over w.unbind(0) (one gradient per stacked weight; indexing
           w[i] built a full-size zero gradient per expert, quadratic in the experts): on a CPU
           where the grouped product does not apply (fp64), where it is faster than the padded form
           (bench/moe_experts.py); on a GPU when padding would more than double the rows multiplied
           (a routing that sends most rows to a few experts).
`experts_path` says which one a call takes."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# padding may at most double the experts' products and their activations' memory
PADDING_LIMIT = 2.0
# the dtypes torch's grouped product takes, by device type (on CUDA: its kernel's; see experts_path)
_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
_CUDA_MAX_GROUPS = 1024  # the CUDA kernel's limit


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts multiply in: autocast's where it is on (as F.linear's would), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _grouped_kernel_here(device: torch.device, dtype: torch.dtype, groups: int) -> bool:
    """Whether torch's grouped product runs without reading the offsets on the host (CUDA: its bf16
    kernel, built for compute capability 9.x and 10.x, not ROCm) or is the CPU's loop in C++."""
    if not hasattr(F, "grouped_mm") or dtype not in _GROUPED_DTYPES.get(device.type, ()):
        return False
    if device.type == "cpu":
        return True
    return torch.version.hip is None and groups < _CUDA_MAX_GROUPS and \
        _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0] in (9, 10)


def _sixteen_byte_rows(t: torch.Tensor) -> bool:
    """Contiguous, starting and striding on 16 bytes: what the grouped product's operands must be
    (the weights are read transposed, the same bytes)."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def grouped_applies(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether `grouped_experts` runs here: torch's kernel for the device and dtype, every operand
    on 16-byte rows (d_model and d_ff in the compute dtype: the gradients are read so too), rows to
    multiply (an empty operand has no valid strides for its backward)."""
    dtype = compute_dtype(x)
    if x.shape[0] == 0 or not _grouped_kernel_here(x.device, dtype, w_gate.shape[0]):
        return False
    if any(w.dtype != dtype for w in (w_gate, w_up, w_down)) and not torch.is_autocast_enabled(x.device.type):
        return False  # the loop would refuse the mixture too; let it say so
    widths_fit = all(w.shape[-1] * dtype.itemsize % 16 == 0 for w in (w_gate, w_down))
    ready = [t for t in (x, w_gate, w_up, w_down) if t.dtype == dtype]  # the others are cast: fresh, aligned
    return widths_fit and all(_sixteen_byte_rows(t) for t in ready)


def padding_fits(sizes: list[int], rows: int) -> bool:
    """Whether padding every expert's rows to the longest's at most doubles the rows multiplied."""
    return len(sizes) * max(sizes, default=0) <= PADDING_LIMIT * rows


def padded_applies(x: torch.Tensor, sizes: list[int]) -> bool:
    """Whether `padded_experts` runs here (where the grouped product does not): off a CPU (one
    launch per product instead of one per expert), when the padding fits."""
    return x.device.type != "cpu" and padding_fits(sizes, x.shape[0])


def experts_path(x: torch.Tensor, weights: tuple[torch.Tensor, ...], sizes: list[int] | None) -> str:
    """'grouped', 'padded' or 'loop' (see the module's docstring). sizes: the rows per expert on the
    host, needed (and read by the caller) unless the answer is 'grouped'."""
    if grouped_applies(x, *weights):
        return "grouped"
    return "padded" if padded_applies(x, sizes) else "loop"


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: the grouped product's backward takes only
    16-byte rows (a sum's gradient is an expanded view, its strides 0)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_experts(x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                    w_down: torch.Tensor, grouped_mm=None) -> torch.Tensor:
    """The experts by torch's grouped product; counts: rows per expert, on the device (never read
    here). Under autocast the operands are cast as F.linear's would be and the products run with it
    off (the grouped product is not on its lists everywhere). grouped_mm: F.grouped_mm's stand-in
    (the tests' fp64 check of this path on a CPU)."""
    grouped_mm = grouped_mm or F.grouped_mm
    dtype = compute_dtype(x)
    offsets = counts.cumsum(0, dtype=torch.int32)  # offsets[i]: where expert i's rows end
    with torch.autocast(x.device.type, enabled=False):
        w_gate, w_up, w_down = (w.to(dtype).contiguous() for w in (w_gate, w_up, w_down))
        # x cast for each product, as autocast casts it for each F.linear: the two gradients are
        # summed in x's dtype, not in the compute dtype
        gate = grouped_mm(x.to(dtype).contiguous(), w_gate.transpose(1, 2), offs=offsets)
        up = grouped_mm(x.to(dtype).contiguous(), w_up.transpose(1, 2), offs=offsets)
        out = grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offsets)
    return _ContiguousGradient.apply(out)


def _padded_slots(counts: torch.Tensor, rows: int, longest: int) -> torch.Tensor:
    """Each sorted row's place in the (n * longest) padded rows: its expert's block, then its rank
    among the expert's rows; computed on the device (the output size is given: nothing is read)."""
    n = counts.numel()
    expert = torch.repeat_interleave(torch.arange(n, device=counts.device), counts, output_size=rows)
    starts = counts.cumsum(0) - counts
    return expert * longest + torch.arange(rows, device=counts.device) - starts[expert]


def padded_experts(x: torch.Tensor, counts: torch.Tensor, longest: int, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """The experts by three batched products over each expert's rows padded with zeros to `longest`
    (the padding's rows compute zeros and are never gathered back; their gradients are zeros)."""
    n, rows, d_model = counts.numel(), x.shape[0], x.shape[1]
    slots = _padded_slots(counts, rows, longest)
    padded = x.new_zeros(n * longest, d_model).index_copy(0, slots, x).view(n, longest, d_model)
    h = F.silu(torch.bmm(padded, w_gate.transpose(1, 2))) * torch.bmm(padded, w_up.transpose(1, 2))
    out = torch.bmm(h, w_down.transpose(1, 2))
    return out.reshape(n * longest, out.shape[-1]).index_select(0, slots)


def loop_experts(x: torch.Tensor, sizes: list[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor) -> torch.Tensor:
    """One expert at a time: sizes[i] rows through expert i."""
    outs = [F.linear(F.silu(F.linear(rows, gate)) * F.linear(rows, up), down)
            for rows, gate, up, down in zip(x.split(sizes), w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0))]
    return torch.cat(outs)
