"""A model of how NCCL runs operations, for replaying a program's communication without processes.

Each rank runs a host program: it posts operations (never waiting) and waits for some of them.
Operations go to their process group's stream on that rank, which runs them one at a time in the
order they were posted. An operation is a set of parts that run together (a batched
point-to-point call; a collective is one part) and it completes when all its parts have:
- a collective part when every rank of the group has the same collective at the head of its stream;
- a send part and a receive part between two ranks on a group match in the order they were posted
  (no tags), and complete together once both are at the head of their streams: a send completes
  only once its receive is posted (NCCL's rendezvous protocol, its strictest case).
`run` replays the programs until every host is done, or reports a deadlock (no host can move) and
every message received in place of another (a mismatch)."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field


@dataclass
class Part:
    kind: str  # send | recv | collective
    peer: int | None = None  # the other rank of a send or receive
    payload: object = None  # what a send carries, what a receive expects; a collective's name


@dataclass
class Operation:
    rank: int
    group: object
    parts: list[Part]
    done: bool = False
    matched: set[int] = field(default_factory=set)  # indices of parts that have completed


class Replay:
    def __init__(self, programs: dict[int, list[tuple]], groups: dict[object, tuple[int, ...]]):
        """programs[rank]: ("post", op_id, group, [Part, ...]) or ("wait", op_id); groups: members."""
        self.programs, self.groups = programs, groups
        self.position = {rank: 0 for rank in programs}
        self.operations: dict[tuple[int, object], Operation] = {}
        self.streams: dict[tuple[int, object], deque] = defaultdict(deque)
        self.p2p: dict[tuple[object, int, int, str], list] = defaultdict(list)  # (group, from, to, kind) -> parts posted
        self.next_match: dict[tuple, int] = defaultdict(int)
        self.mismatches: list[tuple] = []

    def _post(self, rank: int, op_id, group, parts: list[Part]) -> None:
        operation = Operation(rank, group, parts)
        self.operations[(rank, op_id)] = operation
        self.streams[(rank, group)].append(operation)
        for index, part in enumerate(parts):
            if part.kind in ("send", "recv"):
                ends = (rank, part.peer) if part.kind == "send" else (part.peer, rank)
                self.p2p[(group, *ends, part.kind)].append((operation, index))

    def _head(self, rank: int, group) -> Operation | None:
        stream = self.streams[(rank, group)]
        return stream[0] if stream else None

    def _progress(self) -> bool:
        moved = False
        for (group, sender, receiver, kind), posted in list(self.p2p.items()):
            if kind != "send":
                continue
            receives = self.p2p[(group, sender, receiver, "recv")]
            k = self.next_match[(group, sender, receiver)]  # messages match in order: only the k-th can
            while k < min(len(posted), len(receives)):
                (send_op, s), (recv_op, r) = posted[k], receives[k]
                if not (self._head(sender, group) is send_op and self._head(receiver, group) is recv_op):
                    break
                send_op.matched.add(s)
                recv_op.matched.add(r)
                if send_op.parts[s].payload != recv_op.parts[r].payload:
                    self.mismatches.append((send_op.parts[s].payload, recv_op.parts[r].payload))
                k += 1
                moved = True
            self.next_match[(group, sender, receiver)] = k
        for group, members in self.groups.items():
            heads = [self._head(rank, group) for rank in members]
            if all(h is not None and h.parts[0].kind == "collective" and not h.matched for h in heads):
                names = {h.parts[0].payload for h in heads}
                if len(names) > 1:
                    self.mismatches.append(tuple(sorted(map(str, names))))
                for h in heads:
                    h.matched.add(0)
                moved = True
        for stream in self.streams.values():
            while stream and len(stream[0].matched) == len(stream[0].parts):
                stream.popleft().done = True
                moved = True
        return moved

    def _run_hosts(self) -> bool:
        moved = False
        for rank, program in self.programs.items():
            while self.position[rank] < len(program):
                step = program[self.position[rank]]
                if step[0] == "post":
                    self._post(rank, *step[1:])
                elif not self.operations[(rank, step[1])].done:
                    break
                self.position[rank] += 1
                moved = True
        return moved

    def run(self) -> tuple[bool, list[tuple]]:
        """(every host finished, the mismatched messages)."""
        while self._run_hosts() | self._progress():
            pass
        finished = all(self.position[r] == len(p) for r, p in self.programs.items())
        return finished, self.mismatches
