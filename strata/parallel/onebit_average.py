"""1-bit Adam's compressed average (steps 2 and 3 of the rule in strata/parallel/onebit_adam.py):
a flat buffer of the parameters end to end, padded and cut in dp chunks, averaged over the dp
ranks through an all-to-all of 1-bit chunks and an all-gather of 1-bit averages, with the worker's
and the server's error feedback. Both ZeRO-0's and ZeRO-1's 1-bit strategies hold one: the
average is of whole flat buffers either way (ZeRO-1 shards the update, not the compression).

Worker side, on the flat buffer cut in dp chunks: c = m_r + e_w; its signs, and per piece k (a
unit's part of a chunk: a unit is a tensor, or an embedding's row, rules/compression.onebit_units;
or the padding: rules/compression.onebit_pieces) a scale s_k = ||c_k||_1 / n_k; the error
e_w = c - s sign(c). The chunks go to their owners in one all-to-all (8 signs a byte, the chunk's
scales' bytes after them). Server side, chunk j on rank j: the dp decoded chunks averaged,
x = average + e_s, compressed again (signs, a scale ||x_k||_1 / n_k per piece), e_s = x - s sign(x);
the compressed chunks all-gathered, and every rank decodes the same average.

The scale ||c||_1 / n (DeepSpeed: ||c||_2 / sqrt(n)) is the s that minimises ||c - s sign(c)||_2:
what error feedback carries to the next step is the least it can be. One bit has no zero: the
sign bit decides (copysign's rule: +0 is +1, -0 is -1); the padding is zero in the buffer and both
errors (its piece's scale is 0). A scale per piece, not per chunk: a model's tensors' gradients
differ by hundreds of times, and one scale moves all of a chunk's elements by one amount
(docs/benchmarks.md, the compression paragraph). An embedding's rows each have a scale (its
gradient is zero in the rows of the tokens a batch lacks: with a scale per row they stay zero,
where DeepSpeed asks for momentum masks).

A parameter that is a segment of its own (`apart`: a tied embedding's copy beside a pipeline) is
padded and cut in dp chunks apart from the rest, row j of the collectives carrying every segment's
chunk j side by side: cut with the rest, a copy's pieces would fall where its stage's chunk
boundaries do, which differ between the stages; apart, both stages compute the same bits."""

from __future__ import annotations

import torch
from torch import nn

from strata.distributed import comm
from strata.rules.compression import onebit_padded, onebit_rows, onebit_units

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """8k values -> k bytes of their signs, the first value in the high bit; a bit is 1 where the
    sign bit is clear (+0 is positive)."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=values.device)
    return ((~torch.signbit(values)).view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def sign_table(like: torch.Tensor) -> torch.Tensor:
    """Byte -> its 8 signs as +-1 in `like`'s dtype: decoding is one gather, not 8 bit tests."""
    codes = torch.arange(256, device=like.device).unsqueeze(1)
    bits = codes.bitwise_and(torch.tensor(_BIT_WEIGHTS, device=like.device)).ne(0)
    return bits.to(like.dtype) * 2 - 1


def signed_scales(values: torch.Tensor, lengths: list[int], lengths_on_device: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat tensor cut in pieces of `lengths` -> (each piece's scale ||x||_1 / its length; each
    value as +-its piece's scale, by its sign bit)."""
    scales = torch.stack(torch._foreach_norm(values.split(lengths), 1)).div_(lengths_on_device)
    spread = torch.repeat_interleave(scales, lengths_on_device, output_size=values.numel())
    return scales, spread.copysign_(values)


class OnebitAverage:
    """The flat layout of `params` (each at `offsets[p]`), the two error buffers, and `average`,
    the compressed average of a flat buffer in that layout over `group`."""

    def __init__(self, params: list[nn.Parameter], group, group_name: str, dp_size: int, dp_rank: int,
                 apart: nn.Parameter | None = None, embeddings: tuple[nn.Parameter, ...] = ()):
        """apart: a parameter that is a segment of its own (see the module's docstring).
        embeddings: parameters compressed a scale per row (rules/compression.onebit_units)."""
        self.group, self.group_name, self.dp_size, self.dp_rank = group, group_name, dp_size, dp_rank
        dp, sample = dp_size, params[0]
        apart = apart if any(p is apart for p in params) else None
        segments = [s for s in ([apart], [p for p in params if p is not apart]) if s] if apart is not None else [params]
        # each segment padded on its own and cut in dp chunks; chunk j of the flat buffer (what
        # the collectives' row j carries) is every segment's chunk j, in order
        units = [[n for p in segment
                  for n in onebit_units(p.numel(), p.shape[-1] if any(p is e for e in embeddings) else None)]
                 for segment in segments]
        segment_pieces, self.scales = onebit_rows(units, dp)
        self.offsets, spans, flat_pieces, chunk_pieces, at = {}, [], [], [[] for _ in range(dp)], 0
        for segment, pieces in zip(segments, segment_pieces):
            sizes, start = [p.numel() for p in segment], at
            for p in segment:
                self.offsets[p], start = start, start + p.numel()
            padded = onebit_padded(sum(sizes), dp)
            spans.append((at, sum(sizes), padded))
            flat_pieces += [(j, len(chunk_pieces[j]) + k, n) for j in range(dp) for k, n in enumerate(pieces[j])]
            for j in range(dp):
                chunk_pieces[j] += pieces[j]
            at += padded
        self.size = at  # the flat buffer's elements, padding included
        self.spans = spans  # (start, elements, padded) of each segment in the flat buffer
        self.chunk = at // dp
        self.padding = [(start + n, start + padded) for start, n, padded in spans if padded > n]
        lo, self.own_padding, wire_at = dp_rank, [], 0  # this rank's chunk's padding, in its row
        for _, n, padded in spans:
            width = padded // dp
            if n - lo * width < width:
                self.own_padding.append((wire_at + max(n - lo * width, 0), wire_at + width))
            wire_at += width
        self.dtype, self.device = sample.dtype, sample.device
        # a scale per piece (a unit's part of a chunk, or a segment's padding): every piece's
        # length in the flat order, and its slot in the collectives' rows of `scales` (chunk j's
        # pieces in row j, in order; a chunk with fewer pieces pads its row: self.scales, onebit_rows)
        self.piece_lengths = [n for _, _, n in flat_pieces]
        self.lengths = torch.tensor(self.piece_lengths, device=sample.device)
        self.own_piece_lengths = chunk_pieces[dp_rank]
        self.own_lengths = torch.tensor(self.own_piece_lengths, device=sample.device)
        self.slots = torch.tensor([j * self.scales + k for j, k, _ in flat_pieces], device=sample.device)
        self.worker_error = self.zeros()
        self.server_error = torch.zeros(self.chunk, dtype=sample.dtype, device=sample.device)
        self.table = sign_table(self.worker_error)

    def zeros(self) -> torch.Tensor:
        """A flat buffer in this layout (its padding stays zero)."""
        return torch.zeros(self.size, dtype=self.dtype, device=self.device)

    def view(self, flat: torch.Tensor, param: nn.Parameter, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """`param`'s elements [lo, hi) in a flat buffer of this layout (the whole of it: shaped as it)."""
        at = self.offsets[param]
        if hi is None:
            return flat[at:at + param.numel()].view_as(param)
        return flat[at + lo:at + hi]

    @torch.no_grad()
    def average(self, flat: torch.Tensor) -> None:
        """Every rank's `flat` (the momentum, or 0/1 Adam's gradient) -> their compressed average, the
        same on every rank, in place."""
        dp, chunk = self.dp_size, self.chunk
        corrected = self.worker_error.add_(flat)  # c = m + e_w, in e_w's buffer
        scales, compressed = signed_scales(corrected, self.piece_lengths, self.lengths)
        rows = torch.zeros(dp * self.scales, dtype=scales.dtype, device=scales.device).index_copy_(0, self.slots, scales)
        signs = [pack_signs(part.view(dp, -1)).view(dp, -1) for part in self._segments(corrected)]
        received = self._exchange(comm.all_to_all, signs, rows.view(dp, self.scales))
        corrected.sub_(compressed)  # e_w = c - s sign(c)
        for lo, hi in self.padding:
            self.worker_error[lo:hi] = 0
        # rank j serves chunk j: the dp ranks' rows all carry its pieces' scales
        own = received[:, chunk // 8:].contiguous().view(self.dtype)[:, :len(self.own_lengths)]
        spread = torch.repeat_interleave(own, self.own_lengths, dim=1, output_size=chunk)
        served = self._signs(received[:, :chunk // 8], torch.empty(dp, chunk, dtype=self.dtype, device=flat.device))
        served = served.mul_(spread).sum(0).div_(dp).add_(self.server_error)
        for lo, hi in self.own_padding:  # the padding of this rank's chunk stays zero
            served[lo:hi] = 0
        server_scales, compressed = signed_scales(served, self.own_piece_lengths, self.own_lengths)
        row = torch.zeros(self.scales, dtype=scales.dtype, device=scales.device)
        row[:len(self.own_lengths)] = server_scales
        gathered = self._exchange(comm.all_gather, [pack_signs(served).view(1, -1)], row.view(1, self.scales))
        self.server_error.copy_(served - compressed)
        # every chunk's pieces' scales, in the flat order, spread over their elements
        scales = gathered[:, chunk // 8:].contiguous().view(self.dtype).view(-1).index_select(0, self.slots)
        spread = torch.repeat_interleave(scales, self.lengths, output_size=flat.numel())
        at = 0
        for part in self._segments(flat):
            width = part.numel() // dp
            self._signs(gathered[:, at // 8:(at + width) // 8], part.view(dp, width))
            at += width
        flat.mul_(spread)
        for lo, hi in self.padding:
            flat[lo:hi] = 0

    def _segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat`'s segments, each padded (its rows: its chunks)."""
        return [flat[start:start + padded] for start, _, padded in self.spans]

    def _exchange(self, collective, signs: list[torch.Tensor], scales: torch.Tensor) -> torch.Tensor:
        """Rows of packed signs (each segment's, a row's parts side by side), each row's scales'
        bytes after them, through `collective`: dp such rows out."""
        wire = torch.cat([*signs, scales.view(torch.uint8)], dim=1)
        out = torch.empty(self.dp_size, wire.shape[1], dtype=torch.uint8, device=wire.device)
        collective(out, wire, self.group, self.group_name)
        return out

    def _signs(self, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of packed signs -> `out`'s rows of +-1 (out contiguous)."""
        return torch.index_select(self.table, 0, packed.reshape(-1).int(), out=out.view(-1, 8)).view_as(out)

    # --- the state beside the optimizer's -----------------------------------------------------------
    def errors(self) -> dict[str, torch.Tensor]:
        """This rank's own state (checkpoints write it in this rank's file)."""
        return {"worker_error": self.worker_error, "server_error": self.server_error}

    def load_errors(self, saved: dict[str, torch.Tensor]) -> None:
        for name, tensor in self.errors().items():
            tensor.copy_(saved[name].view_as(tensor))
