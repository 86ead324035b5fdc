"""The units a model is cut into: its inputs (the token embedding, with learned positions and their
norm), each block, its outputs (the final norm and the head). The model lists their modules
(strata/model/transformer.Transformer.units); the pipeline cuts between them (rules/pipeline_cut.py),
ZeRO-3 gathers them one at a time (strata/parallel/zero3.py) and the planner prices one ZeRO-3
collective of each kind per unit (strata/plan/buckets.py)."""

from __future__ import annotations


def unit_count(n_layers: int) -> int:
    """Units of a model (or of the part of it a process holds) with `n_layers` blocks."""
    return n_layers + 2
