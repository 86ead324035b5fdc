"""A pipeline step's timeline: written as a Chrome / Perfetto trace (`--trace FILE`, open it in
ui.perfetto.dev or chrome://tracing) and drawn as a PNG (`strata plot TRACE --out PNG`), one row
per rank, forward / backward / weight-gradient actions as coloured boxes, idle time blank.

`strata schedule` draws the same picture from the schedule alone, with unit costs (simulated), to
see a schedule's shape and bubble before running it."""

from __future__ import annotations

import json

import torch.distributed as dist

from strata.distributed import comm
from strata.errors import CorruptError
from strata.rules.schedules import Schedule, simulate

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
NAMES = {"F": "forward", "B": "backward", "W": "weight grad"}


WAITS_TID = 1000  # the trace's row of rank r's communication waits: WAITS_TID + r


def gather_timeline(executor) -> list[dict] | None:
    """Every rank's timeline of the last step, on global rank 0 (None elsewhere); all ranks call it."""
    mine = [{"kind": t.action.kind, "microbatch": t.action.microbatch, "chunk": t.action.chunk,
             "start": t.start, "end": t.end} for t in executor.timeline]
    # the host's blocked waits for communication that began within the schedule's span (what it
    # did not overlap; on the CPU the actions' clock is the host's too)
    span = executor.timeline[-1].end if executor.timeline else 0.0
    waits = [{"name": f"{op}/{group}", "start": start - executor.t0_host, "end": end - executor.t0_host}
             for op, group, start, end in comm.counter.waits if 0 <= start - executor.t0_host <= span]
    everyone = comm.gather_objects({"rank": dist.get_rank(), "stage": executor.rank, "actions": mine,
                                    "waits": waits}, None, "world")
    return everyone if dist.get_rank() == 0 else None


def write_trace(path: str, ranks: list[dict], meta: dict | None = None) -> None:
    """Chrome trace events: one thread per rank, times in microseconds."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "pipeline step"}}]
    for r in ranks:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r["rank"],
                       "args": {"name": f"rank {r['rank']} (stage {r['stage']})"}})
        for a in r["actions"]:
            events.append({"name": f"{a['kind']}{a['microbatch']}", "cat": NAMES[a["kind"]], "ph": "X",
                           "pid": 0, "tid": r["rank"], "ts": a["start"] * 1e6, "dur": (a["end"] - a["start"]) * 1e6,
                           "args": {"microbatch": a["microbatch"], "chunk": a["chunk"]}})
        if r.get("waits"):  # a row of its own under the rank's: waits fall inside and between actions
            tid = WAITS_TID + r["rank"]
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                           "args": {"name": f"rank {r['rank']} waiting for communication"}})
            events += [{"name": w["name"], "cat": "exposed communication", "ph": "X", "pid": 0, "tid": tid,
                        "ts": w["start"] * 1e6, "dur": (w["end"] - w["start"]) * 1e6} for w in r["waits"]]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "metadata": meta or {}}, f)


def is_trace(path: str) -> bool:
    """A trace written by write_trace (one JSON object with traceEvents), not a metrics JSONL file."""
    try:
        with open(path, "rb") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and "traceEvents" in found


def read_trace(path: str) -> list[dict]:
    """The per-rank timelines back from a trace file written by write_trace."""
    try:
        ranks = _read_trace(path)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CorruptError(f"{path}: not a pipeline trace written by --trace ({type(e).__name__}: {e})") from None
    if not any(rank["actions"] for rank in ranks):
        raise CorruptError(f"{path}: the trace holds no pipeline actions")
    return ranks


def _read_trace(path: str) -> list[dict]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ranks: dict[int, dict] = {}
    events = [e for e in events if e.get("tid", 0) < WAITS_TID]  # the actions' rows
    for e in events:
        if e.get("ph") == "M" and e["name"] == "thread_name":
            stage = int(e["args"]["name"].split("stage ")[1].rstrip(")"))
            ranks[e["tid"]] = {"rank": e["tid"], "stage": stage, "actions": []}
    for e in events:
        if e.get("ph") == "X":
            ranks[e["tid"]]["actions"].append({"kind": e["name"][0], "microbatch": e["args"]["microbatch"],
                                               "chunk": e["args"]["chunk"], "start": e["ts"] / 1e6,
                                               "end": (e["ts"] + e["dur"]) / 1e6})
    return [ranks[r] for r in sorted(ranks)]


def simulated(schedule: Schedule, num_chunks: int, cost: dict[str, float]) -> list[dict]:
    """The timeline the schedule would have with these per-action costs (no communication time)."""
    sim = simulate(schedule, num_chunks, cost)
    return [{"rank": r, "stage": r,
             "actions": [{"kind": a.kind, "microbatch": a.microbatch, "chunk": a.chunk,
                          "start": sim.start[a], "end": sim.finish[a]} for a in actions]}
            for r, actions in enumerate(schedule)]


def idle_fractions(ranks: list[dict]) -> list[float]:
    span = max((a["end"] for r in ranks for a in r["actions"]), default=0.0)
    return [1 - sum(a["end"] - a["start"] for a in r["actions"]) / span if span else 0.0 for r in ranks]


def plot_schedule(ranks: list[dict], out: str, title: str = "") -> None:
    """Ranks as rows, actions as boxes labelled with their micro-batch (chunk as a suffix when a
    rank has several), idle time left blank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max((a["end"] for r in ranks for a in r["actions"]), default=1.0)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.2))
    several = any(len({a["chunk"] for a in r["actions"]}) > 1 for r in ranks)
    for row, r in enumerate(ranks):
        for a in r["actions"]:
            width = a["end"] - a["start"]
            ax.broken_barh([(a["start"], width)], (row - 0.4, 0.8), facecolors=COLOURS[a["kind"]],
                           edgecolors="white", linewidth=0.5)
            label = f"{a['microbatch']}" + (f".{a['chunk'] // len(ranks)}" if several else "")
            if width > span / 80:
                ax.text(a["start"] + width / 2, row, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (unit costs)" if title.startswith("simulated") else "time (s)")
    idle = idle_fractions(ranks)
    ax.set_title(f"{title}  idle per rank: {', '.join(f'{x:.0%}' for x in idle)}".strip())
    ax.legend(handles=[Patch(color=c, label=NAMES[k]) for k, c in COLOURS.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
