"""ParallelDims: the one source of truth for which rank holds which slice of the work.

Rank order (row-major over (pp, dp, cp, tp)): tp innermost, so a tensor-parallel group is a run of
adjacent ranks and stays inside one node on a real cluster; cp next, so a context-parallel group,
which exchanges keys and values in every layer, comes next closest; dp; pp outermost, so pipeline
stages are the groups that cross nodes. Process groups are made in this module only (the device
mesh's from `init_device_mesh`, the rest by enumeration, every rank taking part) and passed to
whoever needs them; no other module builds a group or computes a rank's coordinates
(tests/test_mesh_owner.py checks it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from strata.distributed import comm
from strata.rules.experts import expert_dp_members
from strata.rules.tensor_modes import GROUP_AXES, TensorGrid, group_members


@dataclass(frozen=True)
class Axis:
    """A process group as the layers use it: the group (None when it has one rank), the name its
    collectives are counted under, its size and this rank's place in it."""
    group: object
    name: str
    size: int
    rank: int


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    shards: int = 0  # hybrid sharding: ZeRO's states over this many adjacent dp ranks (0: all of them)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters (gradients are averaged over them): dp x cp."""
        return self.dp * self.cp

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's position on each dimension."""
        return {"pp": rank // (self.dp * self.cp * self.tp), "dp": rank // (self.cp * self.tp) % self.dp,
                "cp": rank // self.tp % self.cp, "tp": rank % self.tp}

    def rank_at(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The named mesh ("pp", "dp", "cp", "tp"); None for a single process (no process group)."""
        if self.world_size == 1:
            return None
        return init_device_mesh(device_type, (self.pp, self.dp, self.cp, self.tp),
                                mesh_dim_names=("pp", "dp", "cp", "tp"))

    def hybrid_groups(self, rank: int, timeout_s: float) -> tuple[object, object]:
        """Hybrid sharding's two groups of this rank, at its (pp, tp) place: the `shards` adjacent
        dp ranks ZeRO shards over (inside a node while it fits, as tp's are), and the ranks at the
        same place of every shard group, the replicas its shard is all-reduced across."""
        replicas = self.dp // self.shards
        made = []
        for members in ([[r * self.shards + s for s in range(self.shards)] for r in range(replicas)],
                        [[r * self.shards + s for r in range(replicas)] for s in range(self.shards)]):
            everywhere = [[self.rank_at(pp, dp, tp) for dp in group] for pp in range(self.pp) for tp in range(self.tp)
                          for group in members]
            mine, _ = dist.new_subgroups_by_enumeration(everywhere, timeout=timedelta(seconds=timeout_s))
            made.append(mine)
        return made[0], made[1]

    def node_group(self, size: int, timeout_s: float):
        """The `size` adjacent dp ranks at this rank's (pp, tp) place (cp 1), inside a node as hybrid
        sharding's shard group is: ZeRO++'s hpZ group. Every rank creates every such group; this rank's."""
        everywhere = [[self.rank_at(pp, start + s, tp) for s in range(size)] for pp in range(self.pp)
                      for tp in range(self.tp) for start in range(0, self.dp, size)]
        mine, _ = dist.new_subgroups_by_enumeration(everywhere, timeout=timedelta(seconds=timeout_s))
        return mine

    def replica_group(self, mesh: DeviceMesh, timeout_s: float):
        """The process group of the ranks that average their gradients: the mesh's dp group, or with
        context parallelism the dp x cp ranks at this rank's (pp, tp) place (torchtitan's
        dp_shard_cp), with the run's collective timeout; None where there is one rank."""
        if self.replicas == 1:
            return None
        if self.cp == 1:
            return mesh["dp"].get_group()
        everywhere = [[self.rank_at(pp, dp, tp, cp) for dp in range(self.dp) for cp in range(self.cp)]
                      for pp in range(self.pp) for tp in range(self.tp)]
        mine, _ = dist.new_subgroups_by_enumeration(everywhere, timeout=timedelta(seconds=timeout_s))
        return mine


def grid_axes(dims: ParallelDims, grid: TensorGrid, rank: int, whole_group, timeout_s: float) -> dict[str, Axis]:
    """The sub-groups of multi-dimensional tensor parallelism (rules/tensor_modes.py's
    GROUP_AXES), this rank's of each kind by name ("tp.row", ...), plus "tp", the whole group.
    Every rank takes part in creating every group, as torch.distributed requires; each gets the
    run's collective timeout (torch gives a new group 30 minutes, not the default group's)."""
    axes = {"tp": Axis(whole_group, "tp", dims.tp, rank % dims.tp)}
    for kind, varying in GROUP_AXES[grid.mode].items():
        members = group_members(grid, varying)
        if len(members[0]) == 1:
            axes[kind] = None
            continue
        everywhere = [[base + t for t in group] for base in range(0, dims.world_size, dims.tp) for group in members]
        mine, _ = dist.new_subgroups_by_enumeration(everywhere, timeout=timedelta(seconds=timeout_s))
        group_rank = dist.get_rank(mine)
        expected = next(group.index(rank) for group in everywhere if rank in group)
        if group_rank != expected:  # the cut of every tensor relies on this order
            raise AssertionError(f"tp.{kind}: rank {rank} is {group_rank} in its group, expected {expected}")
        axes[kind] = Axis(mine, f"tp.{kind}", len(members[0]), group_rank)
    return axes


def expert_axes(dims: ParallelDims, ep: int, rank: int, timeout_s: float) -> tuple[Axis, Axis]:
    """The expert-parallel group (ep adjacent dp ranks; strata/rules/experts.py) and the
    expert-data-parallel group (the ranks holding the same experts) of this rank, each with the
    run's collective timeout; a group of one rank is None."""
    ep_members, edp_members = expert_dp_members(dims.dp, ep)
    axes = []
    for name, members in (("ep", ep_members), ("edp", edp_members)):
        everywhere = [[dims.rank_at(pp, d, tp) for d in group] for pp in range(dims.pp) for tp in range(dims.tp)
                      for group in members]
        mine = next(group for group in everywhere if rank in group)
        group = None
        if len(mine) > 1:
            group, _ = dist.new_subgroups_by_enumeration(everywhere, timeout=timedelta(seconds=timeout_s))
        axes.append(Axis(group, name, len(mine), mine.index(rank)))
    return axes[0], axes[1]



def embedding_group(dims: ParallelDims, rank: int, timeout_s: float):
    """The process group of the first and the last stage's ranks at this rank's (dp, cp, tp) place,
    over which a tied embedding's gradients are summed; None on the other stages. Every rank
    creates every such group (torch.distributed requires it), in the same order."""
    mine = None
    for dp in range(dims.dp):
        for cp in range(dims.cp):
            for tp in range(dims.tp):
                ranks = [dims.rank_at(0, dp, tp, cp), dims.rank_at(dims.pp - 1, dp, tp, cp)]
                group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
                if rank in ranks:
                    mine = group
    return mine


def consecutive_groups(world_size: int, size: int, rank: int):
    """Groups of `size` adjacent ranks covering the world (as the tp groups of a dp x tp layout
    are), every one created by every rank; this rank's."""
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world_size, size)]
    return groups[rank // size]


@dataclass
class Mesh:
    """Every process group of a training run and this rank's coordinates, made here and only
    here (tests/test_mesh_owner.py holds every other module to it): the device mesh's cp, tp and
    pp groups; "dp", the ranks that average gradients (dp x cp); and, on demand, the groups
    that only some layouts need. Every rank calls the same methods in the same order, as
    torch.distributed requires of group creation."""
    dims: ParallelDims
    rank: int
    timeout_s: float
    groups: dict  # "dp", "cp", "tp", "pp" -> the group, None where the dimension has one rank

    @classmethod
    def build(cls, dims: ParallelDims, rank: int, device_type: str, timeout_s: float) -> Mesh:
        mesh = dims.build_mesh(device_type)
        groups = {name: mesh[name].get_group() if mesh is not None and getattr(dims, name) > 1 else None
                  for name in ("cp", "tp", "pp")}
        groups["dp"] = dims.replica_group(mesh, timeout_s) if mesh is not None else None
        hybrid = 0 < dims.shards < dims.dp
        groups["dp_shard"], groups["dp_replicate"] = dims.hybrid_groups(rank, timeout_s) if hybrid else (None, None)
        return cls(dims, rank, timeout_s, groups)

    def coordinate(self, name: str) -> int:
        """This rank's place on the dimension `name` (pp, dp, cp or tp)."""
        return self.dims.coordinates(self.rank)[name]

    def context_axis(self) -> Axis | None:
        return Axis(self.groups["cp"], "cp", self.dims.cp, self.coordinate("cp")) if self.dims.cp > 1 else None

    def tensor_axes(self, grid: TensorGrid) -> dict[str, Axis]:
        """The tensor-parallel group and its grid's sub-groups (`grid_axes`)."""
        return grid_axes(self.dims, grid, self.rank, self.groups["tp"], self.timeout_s)

    def expert_axes(self, ep: int) -> tuple[Axis, Axis]:
        return expert_axes(self.dims, ep, self.rank, self.timeout_s)

    def pipeline_links(self, wraps: bool) -> PipelineLinks:
        return pipeline_links(self.dims, self.rank, wraps, self.timeout_s)

    def embedding_group(self):
        return embedding_group(self.dims, self.rank, self.timeout_s)

    def node_axis(self, size: int) -> Axis | None:
        """ZeRO++'s hpZ group ("dp_node": `size` adjacent dp ranks, ParallelDims.node_group); None for size 1."""
        if size == 1:
            return None
        return Axis(self.dims.node_group(size, self.timeout_s), "dp_node", size, self.coordinate("dp") % size)

    def side_group(self):
        """A gloo group of every rank, apart from the training's own groups: checkpoint saves
        coordinate on it, so a background save never interleaves with training's collectives.
        None for one process."""
        if self.dims.world_size == 1:
            return None
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))



@dataclass(frozen=True)
class PipelineLinks:
    """The pipeline's point-to-point links at one rank's (dp, cp, tp) place: a process group of two
    ranks for each direction and kind of message, so that every group carries one stream of
    messages from one sender to one receiver, posted and received in the same order. On NCCL a
    group's operations run one at a time in issue order and match without tags; with each stream
    on a group of its own, a send waiting for its receive can hold up only later sends of the
    same stream (which that receive precedes), never a receive, a collective or the other
    direction, so the schedule's own order of actions is the only thing that can deadlock, and
    the schedules are checked for that (rules/schedules.simulate). PyTorch does the same for
    unbatched NCCL sends (a communicator per pair of ranks); this also keeps an activation and a
    gradient between the same two ranks apart (with p = 2 and interleaving, both go 0 -> 1).

    Kinds: "activation" (stage s to s + 1), "gradient" (s to s - 1), both modulo p when chunks
    wrap around (interleaving); "control" (generation: the last stage to each other one)."""
    peers: tuple[int, ...]  # the global rank of each stage at this place
    groups: dict  # (kind, from stage, to stage) -> the group, for the links this rank is on

    def group(self, kind: str, sender: int, receiver: int):
        return self.groups[(kind, sender, receiver)]


def _link_ends(kind: str, stages: int, wraps: bool) -> list[tuple[int, int]]:
    if kind == "control":
        return [(stages - 1, s) for s in range(stages - 1)]
    step = 1 if kind == "activation" else -1
    return [(s, (s + step) % stages) for s in range(stages) if wraps or 0 <= s + step < stages]


def pipeline_links(dims: ParallelDims, rank: int, wraps: bool, timeout_s: float,
                   kinds: tuple[str, ...] = ("activation", "gradient")) -> PipelineLinks:
    """This rank's pipeline links (`PipelineLinks`) of the given kinds; wraps: chunks go from the
    last stage back to the first (interleaving), so the links do too. Every rank takes part in
    creating every group, in the same order, as torch.distributed requires."""
    places = [(dp, cp, tp) for dp in range(dims.dp) for cp in range(dims.cp) for tp in range(dims.tp)]
    where = dims.coordinates(rank)
    groups = {}
    for kind in kinds:
        for sender, receiver in _link_ends(kind, dims.pp, wraps):
            everywhere = [[dims.rank_at(sender, dp, tp, cp), dims.rank_at(receiver, dp, tp, cp)]
                          for dp, cp, tp in places]
            mine, _ = dist.new_subgroups_by_enumeration(everywhere, timeout=timedelta(seconds=timeout_s),
                                                        group_desc=f"pp_{kind}_{sender}_to_{receiver}")
            if mine is not None:
                groups[(kind, sender, receiver)] = mine
                comm.label(mine, f"pp {kind} {sender}->{receiver}")
    peers = tuple(dims.rank_at(s, where["dp"], where["tp"], where["cp"]) for s in range(dims.pp))
    return PipelineLinks(peers, groups)


def pick_device(choice: str = "auto") -> torch.device:
    """cuda (one device per local rank) when asked for or available, else cpu. The device is the
    local rank modulo the devices this process sees: all of the node's under torchrun, one under
    Slurm's --gpus-per-task=1 (or CUDA_VISIBLE_DEVICES set per task), where local rank 3's device
    is ordinal 0."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        ordinal = local_rank % max(torch.cuda.device_count(), 1)
        torch.cuda.set_device(ordinal)
        return torch.device("cuda", ordinal)
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float, semantics: str | None = None) -> tuple[int, int, bool]:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU) with a timeout on every
    collective, its communication following `semantics` (comm.configure; None: the environment's).
    Returns (rank, world_size, created): (0, 1, False) when not launched by torchrun; created is
    False when the caller had initialised the group already (and will tear it down)."""
    comm.configure(semantics, device)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return 0, 1, False
    created = not dist.is_initialized()
    if created:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # After a restart (--max-restarts) torchrun's store still holds the dead attempt's keys,
        # among them the peers' old addresses, which a new rank may read before they are
        # rewritten: each attempt gets keys of its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"strata/attempt_{attempt}", store), rank=rank,
                                world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), created


def process_groups() -> frozenset:
    """The process groups this process holds now (see `release_groups`)."""
    return frozenset(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else frozenset()


def release_groups(before: frozenset) -> None:
    """Destroy the process groups made since `before` was taken: a run inside a process group it
    did not create (a library caller's, or the tests', which run many in one process) releases
    what it made, each group's threads and sockets, instead of leaving them to the process."""
    for group in process_groups() - before:
        dist.destroy_process_group(group)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))
