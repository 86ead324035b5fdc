"""Layout-free checkpoints: every rank saves the pieces of the model and optimizer it holds, each
tagged with where it sits in the logical (single-device) tensor, and a rank in any other layout
reads back just the pieces that overlap what it needs.

Where a piece sits is a `Region` of the logical tensor, in the two steps strata's layouts cut it:
  1. tensor parallelism keeps a box: the slice [start, start + length) along one dimension (the box
     may run past the end when the vocabulary is padded to a multiple of tp), and under 2-D, 2.5-D
     and 3-D tensor parallelism a slice along a second dimension too (`more`);
  2. ZeRO keeps a flat range [lo, hi) of that box's elements in row-major order (the whole box
     without ZeRO).
Pipeline parallelism only decides which tensors a rank holds at all. A rank writes a piece only
when no other rank holds the same one: data-parallel replicas (ZeRO-0), tensor-parallel replicas
(norms, replicated K/V) and the last stage's copy of a tied embedding leave it to one owner.

What a piece carries: the parameter's values ("param") and, once the optimizer has stepped,
Adam's two moments ("exp_avg", "exp_avg_sq"), all with the same region. The data go into one
safetensors file per rank, the regions and the rank's random streams into a JSON file next to it."""

from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from safetensors import safe_open

from strata.errors import ConfigError, CorruptError

_SHARD_META = re.compile(r"^shard_(\d+)\.json$")

KINDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Region:
    shape: tuple[int, ...]  # the logical tensor's
    dim: int | None  # the tensor-parallel box is cut along this dimension; None: the whole tensor
    start: int  # the box along `dim`: [start, start + length)
    length: int
    lo: int  # the piece: elements [lo, hi) of the box, flattened row-major
    hi: int
    more: tuple = ()  # further cuts of the box, (dim, start, length) each (multi-dimensional tp)

    @classmethod
    def whole(cls, shape) -> "Region":
        return cls(tuple(shape), None, 0, 0, 0, math.prod(shape))

    @property
    def box(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.bounds())

    def bounds(self) -> list[tuple[int, int]]:
        """The box in logical coordinates, per dimension."""
        bounds = [(0, n) for n in self.shape]
        for dim, start, length in ((self.dim, self.start, self.length), *self.more):
            if dim is not None:
                bounds[dim] = (start, start + length)
        return bounds


@dataclass
class LocalPiece:
    """One tensor the optimizer updates on this rank, and where it belongs."""
    name: str  # the logical parameter
    region: Region
    values: torch.Tensor  # the tensor itself (the parameter, or a view of this rank's ZeRO shard)
    owner: bool  # this rank writes it (it is nobody else's too)


def local_pieces(model, parallel, tp_rank: int, tp_size: int) -> list[LocalPiece]:
    """This rank's pieces, in the optimizer's order (its state i belongs to piece i)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [LocalPiece(names[id(param)], replace(box_region(parallel, param, tp_rank, tp_size), lo=lo, hi=hi),
                       values, parallel.writes(param, tp_rank))
            for values, param, lo, hi in parallel.optimizer_pieces()]


def box_region(parallel, param, tp_rank: int, tp_size: int) -> Region:
    """The whole of what this rank's tensor-parallel cut holds of `param`."""
    spec = parallel.spec_of(param)
    if spec.cuts:
        bounds, cut = spec.box_bounds(), sorted({dim for dim, _, _ in spec.cuts})
        cuts = [(dim, bounds[dim][0], bounds[dim][1] - bounds[dim][0]) for dim in cut]
        return Region(spec.full_shape, *cuts[0], 0, math.prod(b - a for a, b in bounds), tuple(cuts[1:]))
    if spec.dim is None:
        return Region.whole(spec.full_shape)
    length = (spec.padded or spec.full_shape[spec.dim]) // tp_size
    box = tuple(length if d == spec.dim else n for d, n in enumerate(spec.full_shape))
    return Region(spec.full_shape, spec.dim, tp_rank * length, length, 0, math.prod(box))


def version_kind(age: int) -> str:
    """An asynchronous schedule's stashed weights, `age` updates older than the parameters."""
    return f"version{age}"


def snapshot(pieces: list[LocalPiece], optimizer, versions: dict[int, dict[str, torch.Tensor]] | None = None
             ) -> tuple[dict[str, torch.Tensor], dict]:
    """Copies (on the CPU) of what this rank writes, and their index: a consistent state that
    training may go on changing while it is written. versions: an asynchronous schedule's older
    weights, by age, each whole (this rank's tensor-parallel box), written as the pieces are."""
    versions = versions or {}
    states = optimizer.state_dict()["state"] if optimizer is not None else {}
    if states and len(states) != len(pieces):
        raise AssertionError(f"optimizer has {len(states)} states for {len(pieces)} pieces")
    tensors, regions, step = {}, {}, None
    for i, piece in enumerate(pieces):
        if not piece.owner:
            continue
        sources = {"param": piece.values}
        if i in states:
            sources.update(exp_avg=states[i]["exp_avg"], exp_avg_sq=states[i]["exp_avg_sq"])
            step = float(states[i]["step"])
        for age, weights in versions.items():
            sources[version_kind(age)] = weights[piece.name].reshape(-1)[piece.region.lo:piece.region.hi]
        for kind, tensor in sources.items():
            tensors[f"{kind}/{piece.name}"] = tensor.detach().reshape(-1).to("cpu", copy=True)
        regions[piece.name] = asdict(piece.region)
    return tensors, {"regions": regions, "optimizer_step": step, "rng": rng_state(), "versions": sorted(versions)}


class ShardReader:
    """Reads any region of any logical tensor from a checkpoint's shard files, opening only the
    files that hold part of it and checking each file's checksum the first time it is opened."""

    def __init__(self, path: str, files: dict[str, dict], verify):
        self.path, self.verify = path, verify
        self.index: dict[str, list[tuple[str, Region]]] = {}
        self.steps, self.rngs = set(), {}
        self.version_ages: dict[str, set[int]] = {}  # data file -> the older weight versions it holds
        for name in sorted(files):
            found = _SHARD_META.match(name)
            if found is None:
                continue
            self.verify(name)
            try:
                self._index_shard(name, int(found.group(1)))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CorruptError(f"checkpoint {path}: {name} does not describe its pieces ({e!r})") from None
        self._open: dict = {}

    def _index_shard(self, name: str, rank: int) -> None:
        with open(os.path.join(self.path, name), "rb") as f:
            meta = json.loads(f.read())
        data_file = name[:-len(".json")] + ".safetensors"
        for tensor_name, region in meta["regions"].items():
            region = Region(**{**region, "shape": tuple(region["shape"]),
                                "more": tuple(tuple(cut) for cut in region.get("more", ()))})
            self.index.setdefault(tensor_name, []).append((data_file, region))
        if meta["regions"]:  # a rank that only held replicas wrote nothing, and no step
            self.steps.add(meta["optimizer_step"])
        self.version_ages[data_file] = set(meta.get("versions", ()))
        self.rngs[rank] = meta["rng"]

    @property
    def has_optimizer(self) -> bool:
        return bool(self.steps) and None not in self.steps

    def has_version(self, age: int, name: str) -> bool:
        """Whether every piece of `name` was saved with its weights `age` updates older (asynchronous
        schedules save the versions their stage's delay keeps)."""
        return all(age in self.version_ages[file] for file, _ in self._entries(name))

    @property
    def optimizer_step(self) -> float:
        return max(self.steps)

    def names(self) -> list[str]:
        return sorted(self.index)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries(name)[0][1].shape

    def read(self, kind: str, name: str, want: Region) -> torch.Tensor:
        """The elements of `want` (flat), assembled from every saved piece that overlaps it."""
        entries = self._entries(name)
        if want.shape != entries[0][1].shape:
            raise ConfigError(f"checkpoint {self.path}: {name} has shape {list(entries[0][1].shape)}, "
                              f"the model wants {list(want.shape)}")
        if all(saved.bounds() == want.bounds() for _, saved in entries):
            return self._read_same_box(kind, name, want, entries)
        return self._read_any_box(kind, name, want, entries)

    def _entries(self, name):
        if name not in self.index:
            raise ConfigError(f"checkpoint {self.path}: has no tensor {name!r} (the model does not match it)")
        return self.index[name]

    def _data(self, file: str, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        if file not in self._open:
            self.verify(file)
            self._open[file] = safe_open(os.path.join(self.path, file), framework="pt")
        handle = self._open[file]
        if lo is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[lo:hi]

    def _read_same_box(self, kind, name, want: Region, entries) -> torch.Tensor:
        """The common case (the same tensor-parallel cut): flat ranges against flat ranges."""
        out, covered = None, 0
        for file, saved in entries:
            lo, hi = max(saved.lo, want.lo), min(saved.hi, want.hi)
            if lo >= hi:
                continue
            piece = self._data(file, f"{kind}/{name}", lo - saved.lo, hi - saved.lo)
            if out is None:
                out = piece.new_empty(want.hi - want.lo)
            out[lo - want.lo:hi - want.lo] = piece
            covered += hi - lo
        if covered != want.hi - want.lo:
            raise ConfigError(f"checkpoint {self.path}: {kind} of {name} is incomplete "
                              f"({covered} of {want.hi - want.lo} elements saved)")
        return out

    def _read_any_box(self, kind, name, want: Region, entries) -> torch.Tensor:
        """A different tensor-parallel cut: place each overlapping piece in the wanted box."""
        need, got, inside = None, torch.zeros(want.box, dtype=torch.bool), torch.zeros(want.box, dtype=torch.bool)
        logical = [(0, n) for n in want.shape]
        inside[_local(_overlap(want.bounds(), logical), want)] = True  # padding lies outside
        for file, saved in entries:
            overlap = _overlap(_overlap(saved.bounds(), want.bounds()), logical)
            if any(a >= b for a, b in overlap):
                continue
            data = self._data(file, f"{kind}/{name}")
            if need is None:
                need = data.new_zeros(want.box)
            box, mask = data.new_zeros(math.prod(saved.box)), torch.zeros(math.prod(saved.box), dtype=torch.bool)
            box[saved.lo:saved.hi], mask[saved.lo:saved.hi] = data, True
            source, source_mask = box.view(saved.box)[_local(overlap, saved)], mask.view(saved.box)[_local(overlap, saved)]
            target = _local(overlap, want)
            need[target] = torch.where(source_mask, source, need[target])
            got[target] |= source_mask
        missing = (inside & ~got).reshape(-1)[want.lo:want.hi]
        if need is None or missing.any():
            raise ConfigError(f"checkpoint {self.path}: {kind} of {name} is incomplete "
                              f"({int(missing.sum())} wanted elements were never saved)")
        return need.reshape(-1)[want.lo:want.hi].clone()

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _overlap(a, b):
    return [(max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b)]


def _local(bounds, region: Region) -> tuple[slice, ...]:
    """Logical bounds -> slices of `region`'s box."""
    return tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(bounds, region.bounds()))


@torch.no_grad()
def load_pieces(reader: ShardReader, pieces: list[LocalPiece], optimizer) -> bool:
    """Fill this rank's pieces (and the optimizer's moments, when the checkpoint has them) from the
    checkpoint. Returns whether the optimizer state was restored."""
    for piece in pieces:
        piece.values.copy_(reader.read("param", piece.name, piece.region).view_as(piece.values))
    if optimizer is None or not reader.has_optimizer:
        return False
    saved = optimizer.state_dict()
    step = torch.tensor(reader.optimizer_step)
    saved["state"] = {i: {"step": step.clone(),
                          **{kind: reader.read(kind, piece.name, piece.region).view_as(piece.values)
                             for kind in KINDS[1:]}} for i, piece in enumerate(pieces)}
    optimizer.load_state_dict(saved)
    return True


def read_full(reader: ShardReader, names=None) -> dict[str, torch.Tensor]:
    """Every logical parameter (or those of `names` the checkpoint has), whole (for generation
    and conversion)."""
    wanted = reader.names() if names is None else [n for n in reader.names() if n in set(names)]
    return {name: reader.read("param", name, Region.whole(reader.shape(name))).view(reader.shape(name))
            for name in wanted}


# --- random streams -------------------------------------------------------------------------------
def rng_state() -> dict:
    """Every random stream of this process, as JSON."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state().tolist(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "python": [version, list(internal), gauss_next]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
