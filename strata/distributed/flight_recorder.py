"""NCCL failure reports: PyTorch's flight recorder (FR), each rank's ring of its last collectives,
written to disk on a hang, and the one line that names the collective the job hung in.

On NCCL a collective that times out ends the process from the watchdog thread: no Python exception,
so no CollectiveError and no "rank N did not arrive" note for the launcher. With the variables of
`nccl_debug_environment` set, every rank records its last TORCH_FR_BUFFER_SIZE collectives; on a
timeout the watchdog writes them to `<TORCH_FR_DUMP_TEMP_FILE><global rank>` and asks the other
ranks, through the store, to write theirs. gloo records into the same recorder (collectives only:
torch 2.13's gloo records no send or receive) but never writes it; `dump()` does, in the same
format, which is what strata's NCCL rehearsal on gloo calls when its watchdog fires.

A dump is a pickle of plain data, version '2.10': {"version", "pg_config": {pg name: {"name",
"desc", "ranks": "[0, 1]"}}, "pg_status", "entries"}. An entry holds process_group (name, desc),
collective_seq_id (numbered per group), p2p_seq_id, profiling_name ("nccl:all_reduce",
"gloo:all_reduce", "nccl:send 0->1" and "nccl:recv 1<-0" in group ranks), is_p2p, state
(scheduled, started, completed; gloo leaves "scheduled"), retired (its work is done, or failed),
and record_id (per process, from 0: the ring keeps the highest). gloo's pg_config is empty; `dump()`
fills it from torch's own table of groups, so a strata dump names every group's ranks.

torch's reader (torch/distributed/flight_recorder/components/loader.py) unpickles whatever a file
holds, and its analyzer (builder.py) evaluates the ranks' text and wants every rank's dump: a dump
here is read by an unpickler that builds plain data only, and a diagnosis is made from what there
is."""

from __future__ import annotations

import os
import pickle
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Collectives each rank remembers: many steps of a deep pipeline, and a dump of a few MB at most.
BUFFER_SIZE = 2000
# Each setting's names, in the order torch reads them (the first set wins; the second is deprecated).
BUFFER_SIZE_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_FILE_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DUMP_FILE_PREFIX = "rank_"  # a dump is <dir>/rank_<global rank>
_RANK_AT_END = re.compile(r"(\d+)$")


def nccl_debug_environment(dump_dir: str) -> dict[str, str]:
    """What a launcher adds to the ranks' environment for NCCL failure reports: only the settings the
    user has not made (under either of a setting's names), so the user's values win. On gloo they
    only switch the recording on."""
    settings = [
        # the ring (the old name, TORCH_NCCL_TRACE_BUFFER_SIZE, prints a deprecation warning per rank)
        (BUFFER_SIZE_VARIABLES, {"TORCH_FR_BUFFER_SIZE": str(BUFFER_SIZE)}),
        # where the dumps go: both names, for whoever reads either
        (DUMP_FILE_VARIABLES, dict.fromkeys(DUMP_FILE_VARIABLES, os.path.join(dump_dir, DUMP_FILE_PREFIX))),
        # the watchdog writes its rank's dump on a timeout or an NCCL error, and signals the others
        (("TORCH_NCCL_DUMP_ON_TIMEOUT",), {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}),
        # the thread that hears that signal on a rank stuck elsewhere, and writes that rank's dump
        (("TORCH_NCCL_ENABLE_MONITORING",), {"TORCH_NCCL_ENABLE_MONITORING": "1"}),
        # tear the process down on an error without aborting the communicators first: torchrun's
        # agent would set 1, whose abort from the watchdog loses the dump (pytorch/pytorch#121055)
        (("TORCH_NCCL_ASYNC_ERROR_HANDLING",), {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}),
    ]
    return {name: value for names, values in settings if not any(n in os.environ for n in names)
            for name, value in values.items()}


def dump_prefix() -> str | None:
    """Where this process's dump goes, as torch decides it: the first of its variables that is set."""
    return next((os.environ[name] for name in DUMP_FILE_VARIABLES if os.environ.get(name)), None)


def dump(path_prefix: str | None = None) -> str | None:
    """Write this rank's flight recorder to `<prefix><global rank>`, whole or not at all (written
    aside, then renamed), as NCCL's watchdog does on a timeout; the prefix defaults to the
    environment's (`dump_prefix`). Returns the path, or None where no prefix is set."""
    prefix = path_prefix or dump_prefix()
    if not prefix:
        return None
    record = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    record["rank"] = rank
    record["pg_config"] = {**_group_table(), **{name: g for name, g in record.get("pg_config", {}).items() if name}}
    path = f"{prefix}{rank}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial"  # no rank number at its end: read_dumps passes it by
    with open(partial, "wb") as f:
        pickle.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    return path


def _group_table() -> dict[str, dict[str, str]]:
    """Every group of this rank as NCCL's dumps list them: name -> name, desc, ranks (global ranks
    in group-rank order, as text)."""
    if not dist.is_initialized():
        return {}
    world = dist.distributed_c10d._world
    table = {}
    for group, name in world.pg_names.items():
        members = world.pg_group_ranks.get(group, {})
        table[name] = {"name": name, "desc": getattr(group, "group_desc", "") or "",
                       "ranks": str(sorted(members, key=members.get))}
    return table


class _PlainData(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers; refuses anything that names a class or a
    function (unpickling those runs code)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}: a flight-recorder dump holds plain data only")


def read_dump(path: str) -> dict | None:
    """One dump, or None when the file is not one (another file, a pickle of objects, or a dump cut
    short by a rank killed while writing it)."""
    try:
        with open(path, "rb") as f:
            if f.read(1) != b"\x80":  # a pickle of protocol 2 or later, as torch and dump() write
                return None
            f.seek(0)
            record = _PlainData(f).load()
    except Exception:  # noqa: BLE001 - a damaged file can raise anything unpickling: it is no dump
        return None
    if not isinstance(record, dict) or "version" not in record or not isinstance(record.get("entries"), list):
        return None
    return record


def read_dumps(directory: str) -> dict[int, dict]:
    """Every rank's dump in `directory` by global rank: files whose names end in the rank (torch's
    `<prefix><rank>`). Files that are not a whole dump are skipped, so a rank killed while writing
    its dump counts as having left none; of two dumps of one rank, the newer is kept. A directory
    that does not exist holds none."""
    found: dict[int, tuple[float, dict]] = {}
    if not os.path.isdir(directory):
        return {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        at_end = _RANK_AT_END.search(name)
        if at_end is None or not os.path.isfile(path):
            continue
        record = read_dump(path)
        if record is None:
            continue
        rank = record["rank"] if isinstance(record.get("rank"), int) else int(at_end.group(1))
        written = os.path.getmtime(path)
        if rank not in found or written > found[rank][0]:
            found[rank] = (written, record)
    return {rank: record for rank, (_, record) in sorted(found.items())}


# --- the diagnosis -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Op:
    """One entry of a rank's ring."""
    rank: int
    group: str  # the process group's name (the same on every member)
    desc: str
    seq: int  # collective_seq_id, or p2p_seq_id for a send or receive
    op: str  # all_reduce, send, ...
    peer: int | None  # a send's or receive's other side, in group ranks
    p2p: bool
    finished: bool
    created: int
    record: int


@dataclass
class _Finding:
    """A collective (or a send or receive) the job may have hung in."""
    order: int  # 0: ranks missing from it, 1: ranks disagreeing on it, 2: entered by all, unfinished
    group: str
    created: int
    entered: list[int]
    missing: list[int]
    text: str


def _parse_entry(rank: int, entry) -> _Op | None:
    try:
        name, desc = entry["process_group"]
        _, _, what = str(entry["profiling_name"]).partition(":")
        op, _, between = what.partition(" ")
        p2p = bool(entry.get("is_p2p")) or op in ("send", "recv")
        peer = None
        if op == "send" and "->" in between:
            peer = int(between.split("->")[1])
        elif op == "recv" and "<-" in between:
            peer = int(between.split("<-")[1])
        seq = int(entry["p2p_seq_id"] if p2p else entry["collective_seq_id"])
        finished = entry.get("retired") is True or entry.get("state") == "completed"
        desc = "" if desc in (None, "undefined") else str(desc)  # torch's desc for a group given none
        return _Op(rank, str(name), desc, seq, op or "?", peer, p2p, finished,
                   int(entry.get("time_created_ns") or 0), int(entry.get("record_id", -1)))
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def rank_list(ranks) -> str:
    """'0-3, 5': runs of consecutive ranks joined."""
    ranks, runs = sorted(ranks), []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)


def _who(ranks) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)}"


def _members(dumps: dict[int, dict], ops: list[_Op], world_size: int | None) -> dict[str, list[int]]:
    """Each group's global ranks in group-rank order: from the dumps' pg_config (NCCL's, or dump()'s),
    else the ranks seen in it (and the whole world for the default group)."""
    members: dict[str, list[int]] = {}
    for record in dumps.values():
        config = record.get("pg_config")
        for name, group in (config.items() if isinstance(config, dict) else ()):
            ranks = group.get("ranks") if isinstance(group, dict) else None
            ranks = [int(r) for r in re.findall(r"\d+", ranks)] if isinstance(ranks, str) else ranks
            if name and isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
                members.setdefault(str(name), ranks)
    for op in ops:
        if op.group not in members:
            seen = sorted({o.rank for o in ops if o.group == op.group})
            members[op.group] = list(range(world_size)) if op.desc == "default_pg" and world_size else seen
    return members


def diagnose(dumps: dict[int, dict], world_size: int | None = None) -> str | None:
    """One line naming the collective the job hung in, from every rank's dump (`read_dumps`): its
    process group (description, name and ranks), the operation and its number, the ranks that
    entered it and did not finish, and those that never arrived (their last operation on that
    group, and where they wait instead). A send or receive names the peer that never posted its
    side. Ranks that left no dump are named: with world_size every such rank (it died before it
    could write one), else the group's (their dumps are elsewhere, e.g. on another node). None
    when the dumps show no collective that waits."""
    ops = [op for rank, record in dumps.items() for entry in record.get("entries", [])
           if (op := _parse_entry(rank, entry)) is not None]
    members = _members(dumps, ops, world_size)
    by_rank: dict[int, list[_Op]] = defaultdict(list)
    for op in ops:
        by_rank[op.rank].append(op)
    findings = _collective_findings(dumps, ops, members, by_rank) + _p2p_findings(ops, members, by_rank)
    if not findings:
        return None
    waiting = {rank for f in findings for rank in f.entered}
    # The first cause: a hang whose missing ranks are not themselves waiting in another one (a rank
    # missing from tp #5 because it waits in pp #3 is a consequence); then by kind, then the earliest.
    found = min(findings, key=lambda f: (bool(set(f.missing) & waiting), f.order, f.created))
    if world_size:
        absent = [rank for rank in range(world_size) if rank not in dumps]
        return found.text + (f"; no dump from {_who(absent)} (died before it could write one)" if absent else "")
    absent = [rank for rank in members.get(found.group, []) if rank not in dumps]
    return found.text + (f"; no dump here from {_who(absent)}" if absent else "")


def _label(group: str, desc: str, members: list[int]) -> str:
    named = f"process group {desc!r} (name {group!r}" if desc else f"process group {group!r} ("
    return f"{named}{', ' if desc else ''}ranks [{rank_list(members)}])"


def _last_words(rank: int, group: str, ops_of_rank: list[_Op], entered_on_group: str) -> str:
    """'rank 3 last entered all_reduce #6 on it (waiting in all_gather #4 on 'mesh_tp')': where the
    rank is stuck instead, when its last operation is elsewhere and unfinished."""
    text = f"rank {rank} {entered_on_group}"
    latest = max(ops_of_rank, key=lambda o: o.record, default=None)
    if latest is not None and latest.group != group and not latest.finished:
        text += f" (waiting in {latest.op} #{latest.seq} on process group {latest.desc or latest.group!r})"
    return text


def _collective_findings(dumps, ops, members, by_rank) -> list[_Finding]:
    """Per group: the first collective some member has not entered while another has (a member's
    place known from its ring: its highest number on the group; none entered when its ring still
    holds its first record), ranks disagreeing on the operation at one number, and a collective
    all entered that some did not finish."""
    entries: dict[tuple[str, int], list[_Op]] = defaultdict(list)
    last: dict[str, dict[int, int]] = defaultdict(dict)
    for op in ops:
        if not op.p2p:
            entries[(op.group, op.seq)].append(op)
            last[op.group][op.rank] = max(last[op.group].get(op.rank, 0), op.seq)
    complete = {rank for rank, record in dumps.items()  # rings that still hold their first record
                if any(o.record == 0 for o in by_rank.get(rank, ()))}
    findings = []
    for group, places in last.items():
        desc = next(op.desc for op in ops if op.group == group)
        for rank in members[group]:
            if rank not in places and rank in complete:
                places[rank] = 0
        label = _label(group, desc, members[group])
        first = min(places.values()) + 1
        at_first = entries.get((group, first), [])
        kinds = {op.op for op in entries.get((group, first - 1), [])}
        if len(kinds) > 1:  # a desync: each rank went on its own path at the same number
            disagree = entries[(group, first - 1)]
            said = "; ".join(f"{_who([o.rank for o in disagree if o.op == kind])} in {kind}" for kind in sorted(kinds))
            findings.append(_Finding(1, group, min(o.created for o in disagree), [o.rank for o in disagree], [],
                                     f"the ranks disagree at collective #{first - 1} on {label}: {said} (they took "
                                     f"different paths through the code)"))
        elif at_first:
            entered = sorted(rank for rank, seq in places.items() if seq >= first)
            missing = sorted(rank for rank, seq in places.items() if seq < first)
            op = Counter(o.op for o in at_first).most_common(1)[0][0]
            before = {o.rank: o for o in entries.get((group, first - 1), [])}
            words = [_last_words(rank, group, by_rank[rank], f"last entered {before[rank].op} #{first - 1} on it"
                                 if rank in before else "entered nothing on it") for rank in missing]
            findings.append(_Finding(0, group, min(o.created for o in at_first), entered, missing,
                                     f"{_who(missing)} did not arrive at collective {op} #{first} on {label}: "
                                     f"{_who(entered)} entered it and did not finish; " + "; ".join(words)))
        else:
            hung = [o for o in entries.get((group, first - 1), []) if not o.finished]
            if hung and not any(o.finished for o in entries[(group, first - 1)]):
                entered = sorted(o.rank for o in entries[(group, first - 1)])
                findings.append(_Finding(2, group, min(o.created for o in hung), entered, [],
                                         f"collective {hung[0].op} #{first - 1} on {label} did not finish: "
                                         f"{_who(entered)} entered it"))
    return findings


def _p2p_findings(ops, members, by_rank) -> list[_Finding]:
    """A send or receive that did not finish while its peer has not posted the other side (NCCL
    records them; gloo does not)."""
    findings = []
    for op in ops:
        if not op.p2p or op.finished or op.peer is None or op.peer >= len(members.get(op.group, [])):
            continue
        group_members = members[op.group]
        peer = group_members[op.peer]
        mine = group_members.index(op.rank) if op.rank in group_members else None
        other = "recv" if op.op == "send" else "send"
        if any(o.p2p and not o.finished and o.group == op.group and o.op == other and o.peer == mine
               for o in by_rank.get(peer, ())):
            continue  # both sides are posted: not a missing peer
        label = _label(op.group, op.desc, group_members)
        on_group = [o for o in by_rank.get(peer, ()) if o.group == op.group]
        latest = max(on_group, key=lambda o: o.record, default=None)
        words = (_last_words(peer, op.group, by_rank[peer], f"last entered {latest.op} #{latest.seq} on it"
                             if latest else "entered nothing on it") if peer in by_rank else "")
        findings.append(_Finding(0, op.group, op.created, [op.rank], [peer],
                                 f"rank {peer} did not post its side of rank {op.rank}'s {op.op} #{op.seq} "
                                 f"({'to' if op.op == 'send' else 'from'} rank {peer}) on {label}: rank {op.rank} "
                                 f"entered it and did not finish" + (f"; {words}" if words else "")))
    return findings
