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
Adam's two moments ("exp_avg", "exp_avg_sq"), all with the same region; a persistent buffer
(DeepSeek-V3's expert bias) its values alone. The data go into one safetensors file per rank, the
regions, the rank's random streams and what its optimizer keeps for it alone (1-bit Adam's
errors) into a JSON file next to it."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace

import torch
from safetensors import SafetensorError, safe_open

from strata.checkpoint.random_streams import rng_problem, rng_state, set_rng_state  # noqa: F401 (set_rng_state: run_state reads it here)
from strata.checkpoint.records import whole
from strata.checkpoint.safetensors_file import read_header
from strata.errors import ConfigError, CorruptError
from strata.files import inside, read_json_object

_SHARD_META = re.compile(r"^shard_(\d+)\.json$")

KINDS = ("param", "exp_avg", "exp_avg_sq")
BUFFERS = "buffers"  # a rank's JSON: the tensors it wrote that are persistent buffers (a "param" alone, no moments)
RANK_STATE = "rank_state"  # an optimizer state_dict's entry of tensors kept per rank (1-bit Adam's errors)


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
    trained: bool = True  # an optimizer's (its moments saved with it), or a persistent buffer


def local_pieces(model, parallel, tp_rank: int, tp_size: int, writes_buffers: bool = False) -> list[LocalPiece]:
    """This rank's pieces, in the optimizer's order (its state i belongs to piece i), then the
    model's persistent buffers, whole on every rank that holds their layer (written by the one
    told `writes_buffers`: the first of the ranks holding the same layers)."""
    names = {id(p): name for name, p in model.named_parameters()}
    trained = [LocalPiece(names[id(param)], replace(box_region(parallel, param, tp_rank, tp_size), lo=lo, hi=hi),
                          values, parallel.writes(param, tp_rank))
               for values, param, lo, hi in parallel.optimizer_pieces()]
    persistent = model.state_dict().keys()
    return trained + [LocalPiece(name, Region.whole(tuple(buf.shape)), buf, writes_buffers, trained=False)
                      for name, buf in model.named_buffers() if name in persistent]


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
    saved = optimizer.state_dict() if optimizer is not None else {}
    states = saved.get("state", {})
    trained = sum(piece.trained for piece in pieces)
    if states and len(states) != trained:
        raise AssertionError(f"optimizer has {len(states)} states for {trained} pieces")
    tensors, regions, step = {}, {}, None
    for i, piece in enumerate(pieces):
        if not piece.owner:
            continue
        sources = {"param": piece.values}
        if i in states:
            sources.update(exp_avg=states[i]["exp_avg"], exp_avg_sq=states[i]["exp_avg_sq"])
            step = float(states[i]["step"])
        for age, weights in versions.items() if piece.trained else ():
            sources[version_kind(age)] = weights[piece.name].reshape(-1)[piece.region.lo:piece.region.hi]
        for kind, tensor in sources.items():
            tensors[f"{kind}/{piece.name}"] = tensor.detach().reshape(-1).to("cpu", copy=True)
        regions[piece.name] = asdict(piece.region)
    own = saved.get(RANK_STATE, {})  # kept by this rank alone (1-bit Adam's errors): in its own file only
    tensors.update({f"{RANK_STATE}/{name}": t.detach().reshape(-1).to("cpu", copy=True) for name, t in own.items()})
    return tensors, {"regions": regions, "optimizer_step": step, "rng": rng_state(), "versions": sorted(versions),
                     RANK_STATE: sorted(own), BUFFERS: sorted(p.name for p in pieces if p.owner and not p.trained)}


class ShardReader:
    """Reads any region of any logical tensor from a checkpoint's shard files, opening only the
    files that hold part of it and checking each file's checksum the first time it is opened.

    What can be checked without the data is checked when the reader is made: each rank's JSON
    (its checksum, then every region, step, random stream and version), and each data file's
    safetensors header against the file's size and against the regions (every piece there, as
    many elements as its region says, every tensor's pieces as many elements as its shape). A
    damaged file is one line naming it, and no read allocates more than the files hold."""

    def __init__(self, path: str, files: dict[str, dict], verify):
        self.path, self.verify = path, verify
        self.index: dict[str, list[tuple[str, Region]]] = {}
        self.steps, self.rngs = set(), {}
        self.version_ages: dict[str, set[int]] = {}  # data file -> the older weight versions it holds
        self.rank_states: dict[int, tuple[str, list]] = {}  # rank -> (its data file, the names it kept alone)
        self._kinds: dict[str, tuple[str, ...]] = {}  # data file -> the kinds each of its pieces has
        self._buffers: dict[str, set[str]] = {}  # data file -> its pieces that are buffers: a "param" kind alone
        self._pieces: dict[str, list[tuple[str, Region]]] = {}  # data file -> (tensor, region) of its pieces
        for name in sorted(files):
            found = _SHARD_META.match(name)
            if found is not None:
                self._index_shard(name, int(found.group(1)), files)
        if sorted(self.rngs) != list(range(len(self.rngs))):
            raise CorruptError(f"checkpoint {path}: has shard files of ranks {sorted(self.rngs)[:8]}; want 0 to "
                               f"{len(self.rngs) - 1}, one each")
        for tensor_name, entries in self.index.items():
            _check_cover(tensor_name, entries, f"checkpoint {path}")
        for data_file in self._kinds:
            self._check_data_file(data_file)
        self._open: dict = {}

    def _index_shard(self, name: str, rank: int, files: dict) -> None:
        what = f"checkpoint {self.path}: {name}"
        meta = read_json_object(self.verify(name), "where a rank's pieces sit")
        data_file = name[:-len(".json")] + ".safetensors"
        if data_file not in files:
            raise CorruptError(f"checkpoint {self.path}: {data_file} is not in the manifest (its {name} is)")
        regions, step, versions = meta.get("regions"), meta.get("optimizer_step"), meta.get("versions", [])
        if not isinstance(regions, dict):
            raise CorruptError(f"{what}: 'regions' must map each tensor to its region")
        if step is not None and not (isinstance(step, (int, float)) and not isinstance(step, bool)
                                     and 0 <= step < 2 ** 53):  # a float counts exactly up to 2**53
            raise CorruptError(f"{what}: optimizer_step {step!r} is not a step count")
        if not isinstance(versions, list) or not all(whole(age) and age >= 1 for age in versions):
            raise CorruptError(f"{what}: versions {versions!r} must list whole numbers >= 1")
        problem = rng_problem(meta.get("rng"))
        if problem:
            raise CorruptError(f"{what}: its random streams are damaged ({problem})")
        self._pieces[data_file] = [(tensor_name, region_from_json(region, f"{what}: {tensor_name!r}"))
                                   for tensor_name, region in regions.items()]
        for tensor_name, region in self._pieces[data_file]:
            self.index.setdefault(tensor_name, []).append((data_file, region))
        if regions:  # a rank that only held replicas wrote nothing, and no step
            self.steps.add(step)
        self.version_ages[data_file] = set(versions)
        own, buffers = (_names(meta, key, what) for key in (RANK_STATE, BUFFERS))
        self.rank_states[rank], self._buffers[data_file] = (data_file, own), set(buffers)
        self._kinds[data_file] = ("param",) + (KINDS[1:] if step is not None else ()) + \
            tuple(version_kind(age) for age in sorted(set(versions)))
        self.rngs[rank] = meta["rng"]

    def _check_data_file(self, data_file: str) -> None:
        """The data file's header against its size and against the regions its JSON gives (checked
        against the manifest's checksum first when it is not valid: a file altered since it was
        saved is said so)."""
        what = f"checkpoint {self.path}: {data_file}"
        file = inside(self.path, data_file, f"checkpoint {self.path}")
        try:
            header = read_header(file, what)
        except CorruptError:
            self.verify(data_file)
            raise
        for tensor_name, region in self._pieces[data_file]:
            for kind in self._kinds[data_file] if tensor_name not in self._buffers[data_file] else ("param",):
                key = f"{kind}/{tensor_name}"
                if key not in header:
                    raise CorruptError(f"{what}: holds no {key!r}, which its {data_file[:-12]}.json lists")
                if header[key].shape != (region.hi - region.lo,):
                    raise CorruptError(f"{what}: {key!r} has shape {list(header[key].shape)}; its region "
                                       f"holds {region.hi - region.lo} elements")

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
            values = self._read_same_box(kind, name, want, entries)
        else:
            values = self._read_any_box(kind, name, want, entries)
        if values.is_floating_point() and not torch.isfinite(values).all():  # training never saves them
            raise CorruptError(f"checkpoint {self.path}: {kind} of {name} holds values that are not finite (NaN or "
                               f"infinity)")
        return values

    def _entries(self, name):
        if name not in self.index:
            raise ConfigError(f"checkpoint {self.path}: has no tensor {name!r} (the model does not match it)")
        return self.index[name]

    def _data(self, file: str, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        try:
            if file not in self._open:
                self._open[file] = safe_open(self.verify(file), framework="pt")
            handle = self._open[file]
            if lo is None:
                return handle.get_tensor(key)
            return handle.get_slice(key)[lo:hi]
        except (SafetensorError, OSError) as e:  # its header was checked: the file changed since
            raise CorruptError(f"checkpoint {self.path}: {file} cannot be read ({str(e).splitlines()[0]})") from None

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


REGION_FIELDS = ("shape", "dim", "start", "length", "lo", "hi")


def region_from_json(raw: object, what: str) -> Region:
    """A Region as a shard's JSON records it, every field checked: a logical shape of whole numbers
    >= 1, cuts along distinct dimensions of it, each no longer than its dimension (where a box
    starts may lie past the end: a padded vocabulary's last boxes), and a flat range inside the box."""
    if not isinstance(raw, dict) or not set(REGION_FIELDS) <= set(raw) or set(raw) - {*REGION_FIELDS, "more"}:
        raise CorruptError(f"{what}: a region must have {', '.join(REGION_FIELDS)}, and may have more")
    shape, more = raw["shape"], raw.get("more", [])
    if not isinstance(shape, list) or not shape or not all(whole(n) and n >= 1 for n in shape):
        raise CorruptError(f"{what}: shape {shape!r} must list whole numbers >= 1")
    if not isinstance(more, list) or not all(isinstance(cut, list) and len(cut) == 3 for cut in more):
        raise CorruptError(f"{what}: more {more!r} must list [dim, start, length] cuts")
    cuts = [(raw["dim"], raw["start"], raw["length"])] + [tuple(cut) for cut in more]
    if raw["dim"] is None:
        if more or raw["start"] != 0 or raw["length"] != 0:
            raise CorruptError(f"{what}: an uncut tensor has start 0, length 0 and no more cuts")
        cuts = []
    dims = [dim for dim, _, _ in cuts]
    for dim, start, length in cuts:
        if not (whole(dim) and dim < len(shape) and whole(start) and whole(length)) or dims.count(dim) > 1 \
                or not 1 <= length <= shape[dim]:
            raise CorruptError(f"{what}: the cut {[dim, start, length]} does not fit in shape {shape}")
    region = Region(tuple(shape), raw["dim"], raw["start"], raw["length"], 0, 0,
                    tuple(tuple(cut) for cut in more))
    lo, hi = raw["lo"], raw["hi"]
    if not (whole(lo) and whole(hi) and lo <= hi <= math.prod(region.box)):
        raise CorruptError(f"{what}: the range [{lo!r}, {hi!r}) does not fit in its box of {math.prod(region.box)} "
                           f"elements")
    return replace(region, lo=lo, hi=hi)


def _check_cover(name: str, entries: list[tuple[str, Region]], what: str) -> None:
    """A tensor's pieces agree on its shape and hold at least as many elements as it has (every
    element is saved by some rank): what a read allocates is bounded by what the files hold."""
    shape = entries[0][1].shape
    if any(region.shape != shape for _, region in entries):
        raise CorruptError(f"{what}: the pieces of {name!r} disagree on its shape "
                           f"({sorted({list(r.shape).__repr__() for _, r in entries})[:2]})")
    held = sum(region.hi - region.lo for _, region in entries)
    if held < math.prod(shape):
        raise CorruptError(f"{what}: {name!r} has shape {list(shape)} ({math.prod(shape)} elements) and its pieces "
                           f"hold {held}")



def _overlap(a, b):
    return [(max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b)]


def _names(meta: dict, key: str, what: str) -> list[str]:
    """A rank JSON's list of tensor names under `key` (none when absent)."""
    names = meta.get(key, [])
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise CorruptError(f"{what}: {key} {names!r} must list the names of tensors")
    return names


def _local(bounds, region: Region) -> tuple[slice, ...]:
    """Logical bounds -> slices of `region`'s box."""
    return tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(bounds, region.bounds()))


@torch.no_grad()
def load_pieces(reader: ShardReader, pieces: list[LocalPiece], optimizer, rank: int = 0) -> bool:
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
                             for kind in KINDS[1:]}} for i, piece in enumerate(pieces) if piece.trained}
    if RANK_STATE in saved:  # an optimizer keeping state per rank: what the same rank saved (flat), if any
        file, own = reader.rank_states.get(rank, ("", []))
        saved[RANK_STATE] = {name: reader._data(file, f"{RANK_STATE}/{name}") for name in own}
    optimizer.load_state_dict(saved)
    return True


def read_full(reader: ShardReader, names=None) -> dict[str, torch.Tensor]:
    """Every logical parameter (or those of `names` the checkpoint has), whole (for generation
    and conversion)."""
    wanted = reader.names() if names is None else [n for n in reader.names() if n in set(names)]
    return {name: reader.read("param", name, Region.whole(reader.shape(name))).view(reader.shape(name))
            for name in wanted}
