"""The ways of cutting tensor parallelism's matrices: Megatron's 1-D (Shoeybi et al. 2019) and
Colossal-AI's multi-dimensional ones, 2-D (Xu et al. 2021, SUMMA on a q x q grid), 2.5-D (Wang
et al. 2021, "Tesseract", q x q x d) and 3-D (Bian et al. 2021, q x q x q). One place for the
runtime (strata/parallel/tensor_nd.py, strata/distributed/mesh.py) and the planner: which sizes a
mode takes, what a model needs to be cut so, how a rank's share of each tensor shrinks, where each
rank sits on the grid and which sub-groups it belongs to. (The bytes a rank sends:
tensor_traffic.py.)

The multi-dimensional modes cut the activations as well as the weights: between layers a rank
holds 1/|B| of the micro-batch's sequences (|B| = q for 2-D, q·d for 2.5-D, q² for 3-D) and 1/q of
the hidden features, so 1/tp of the activations, where 1-D holds all of them on every rank."""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.model.config import FAMILY_PLACEMENTS, ModelConfig

TP_MODES = ("1d", "2d", "2.5d", "3d")


@dataclass(frozen=True)
class TensorGrid:
    """The shape of a tensor-parallel group: mode, the grid's side q and its depth d."""
    mode: str
    q: int
    d: int = 1

    @property
    def size(self) -> int:
        return {"1d": self.q, "2d": self.q * self.q, "2.5d": self.q * self.q * self.d, "3d": self.q ** 3}[self.mode]

    @property
    def batch_parts(self) -> int:
        """How many ways a micro-batch's sequences are split between the layers (1 for 1-D)."""
        return {"1d": 1, "2d": self.q, "2.5d": self.q * self.d, "3d": self.q * self.q}[self.mode]

    @property
    def hidden_parts(self) -> int:
        """How many ways the hidden features between layers are split (1 for 1-D: replicated)."""
        return 1 if self.mode == "1d" else self.q

    @property
    def weight_parts(self) -> int:
        """How many ways a weight matrix is cut (2.5-D's d layers each hold the q x q blocks)."""
        return {"1d": self.q, "2d": self.q * self.q, "2.5d": self.q * self.q, "3d": self.q ** 3}[self.mode]

    @property
    def weight_in_parts(self) -> int:
        """How many ways a weight's input features are split on a rank (3-D cuts them q² ways)."""
        return {"1d": 1, "2d": self.q, "2.5d": self.q, "3d": self.q * self.q}[self.mode]


def grid_of(mode: str, tp: int, depth: int = 1, field: str = "tp") -> TensorGrid:
    """The grid of `tp` ranks in `mode`, or ConfigError naming what sizes would do."""
    if mode not in TP_MODES:
        raise ConfigError(f"valid: {', '.join(TP_MODES)}", "tp_mode", mode)
    if depth < 1:
        raise ConfigError("must be >= 1", "tp_depth", depth)
    if depth != 1 and mode != "2.5d":
        raise ConfigError(f"is the depth of 2.5-D tensor parallelism; tp_mode is {mode}", "tp_depth", depth)
    if mode == "2.5d" and depth == 1:
        raise ConfigError("tp_mode 2.5d needs tp_depth >= 2 (with depth 1 it is tp_mode 2d)", "tp_depth", depth)
    if mode == "1d":
        return TensorGrid("1d", tp)
    side = {"2d": 2, "2.5d": 2, "3d": 3}[mode]
    q = round((tp / depth) ** (1 / side))
    if q < 2 or q ** side * depth != tp:
        shape = {"2d": "q² (4, 9, 16, ...)", "2.5d": f"q² x tp_depth {depth} with q >= 2 "
                 f"({', '.join(str(n * n * depth) for n in (2, 3, 4))}, ...)", "3d": "q³ (8, 27, 64, ...)"}[mode]
        raise ConfigError(f"tp_mode {mode} needs {shape} ranks", field, tp)
    return TensorGrid(mode, q, depth)


# The placements (model/families/base.PLACEMENTS) the grids cut (parallel/tensor_nd.py's methods;
# tests/test_tensor_nd.py holds the two alike); a mixture's are refused by rules/experts.py.
GRID_PLACEMENTS = frozenset({"vocabulary", "column", "kv_column", "row", "input_norm", "head_norm", "replicated"})
EXPERT_PLACEMENTS = frozenset({"moe", "stacked_experts"})


def check_grid(model: ModelConfig, grid: TensorGrid, micro_batch: int) -> None:
    """Can this model be cut over the grid, and a micro-batch split between its sequence groups?"""
    if grid.mode == "1d":
        return
    q, name = grid.q, f"tp_mode {grid.mode}"
    uncut = FAMILY_PLACEMENTS.get(model.family, frozenset()) - GRID_PLACEMENTS - EXPERT_PLACEMENTS
    if uncut:  # (a mixture's experts: rules/experts.py says why not)
        raise ConfigError(f"the {model.family} family's {', '.join(sorted(uncut))} placement has no cut on a grid; "
                          f"use tp_mode 1d", "tp_mode", grid.mode)
    if micro_batch % grid.batch_parts:
        raise ConfigError(f"must be a multiple of {grid.batch_parts} with {name} on {grid.size} ranks (each "
                          f"group of ranks holds 1/{grid.batch_parts} of a micro-batch's sequences)",
                          "micro_batch", micro_batch)
    for what, heads in (("attention heads", model.n_heads), ("KV heads", model.kv_heads)):
        if heads % q:
            raise ConfigError(f"{name}: the model's {heads} {what} must be a multiple of q = {q}", "tp", grid.size)
    parts = grid.weight_in_parts  # the matrices' input features (the KV width is only ever an output)
    for what, width in (("d_model", model.d_model), ("d_ff", model.d_ff), ("q width", model.q_dim)):
        if width % parts:
            raise ConfigError(f"{name}: the model's {what} {width} must be a multiple of {parts}", "tp", grid.size)


def padded_vocab(vocab: int, grid: TensorGrid) -> int:
    """The vocabulary rounded up to a multiple of every way the embedding and head cut it."""
    return math.ceil(vocab / grid.size) * grid.size


# --- where a rank sits on the grid ------------------------------------------------------------------
# A rank's place t in its tensor-parallel group (t = 0 .. size-1, consecutive global ranks) -> its
# coordinates. 2-D/2.5-D: t = k·q² + i·q + j (grid row i, column j, depth layer k); 3-D:
# t = l·q² + j·q + i. The orders are chosen so that every group below, listed by increasing global
# rank, numbers its members in the order the tensors are cut: a group's rank is the index of the
# piece its member holds.
def coordinates(grid: TensorGrid, t: int) -> dict[str, int]:
    q = grid.q
    if grid.mode in ("2d", "2.5d"):
        return {"k": t // (q * q), "i": t // q % q, "j": t % q}
    return {"l": t // (q * q), "j": t // q % q, "i": t % q}


# The groups of each mode, by the coordinates that vary along them (the others are fixed).
#   2-D / 2.5-D: row (features of activations split along it), col (a weight's input features),
#   depth (2.5-D's layers, each a copy of the weights), batch (the sequences: column and depth).
#   3-D: x, w, y (Bian et al.'s input, weight and output axes of a layer reading features split
#   along i; a layer reading features split along j swaps i and j), and the two batch groups.
GROUP_AXES = {
    "2d": {"row": ("j",), "col": ("i",), "batch": ("i",)},
    "2.5d": {"row": ("j",), "col": ("i",), "depth": ("k",), "batch": ("k", "i")},
    "3d": {"i": ("i",), "j": ("j",), "l": ("l",), "batch_j": ("l", "j"), "batch_i": ("l", "i")},
}


def group_members(grid: TensorGrid, varying: tuple[str, ...]) -> list[list[int]]:
    """The places t of every group along `varying` (one list per group, increasing)."""
    groups: dict[tuple, list[int]] = {}
    for t in range(grid.size):
        c = coordinates(grid, t)
        groups.setdefault(tuple(v for k, v in sorted(c.items()) if k not in varying), []).append(t)
    return list(groups.values())


def members_of(grid: TensorGrid, kind: str) -> list[int]:
    """The places t in the tensor-parallel group of the first sub-group of `kind` ("tp": all of
    them), for the planner's link model: which of them share a node."""
    if kind == "tp":
        return list(range(grid.size))
    return group_members(grid, GROUP_AXES[grid.mode][kind])[0]
