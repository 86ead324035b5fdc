"""The pipeline's messages replayed under NCCL's rules (tests/nccl_model.py), without processes, for
every schedule over a range of stages p, micro-batches m and virtual stages v: the executor's order
of posts and waits, on the links it uses (one group per direction and kind between two stages,
distributed/mesh.PipelineLinks), never deadlocks and never delivers a message to the wrong receive.

The same replay of the design before the links (every message on the pipeline group, a step's
sends batched with the next receive, tags ignored, a device-wide synchronize at a step's end)
hangs or mixes messages up where issue 50 found it did: the model can fail."""

from __future__ import annotations

import pytest

from strata.rules.schedules import SCHEDULES, Action, build, messages, segment

from nccl_model import Part, Replay


def _link(message) -> tuple:
    return ("link", message.kind, message.sender, message.receiver)


def _payload(message) -> tuple:
    return (message.kind, message.microbatch, message.chunk)


class _Program:
    """One rank's host program as the executor and the trainer issue it."""

    def __init__(self, rank: int):
        self.rank, self.steps, self.ids = rank, [], 0

    def post(self, group, parts: list[Part]) -> int:
        self.ids += 1
        self.steps.append(("post", self.ids, group, parts))
        return self.ids

    def wait(self, op_id: int) -> None:
        self.steps.append(("wait", op_id))

    def collective(self, group, name: str) -> int:
        return self.post(group, [Part("collective", payload=name)])


def _run_actions(program: _Program, actions: list[Action], p: int, chunks: int, sends: list[int]) -> None:
    """PipelineExecutor._run: a receive posted and waited for right before its action, a send
    posted right after (never waited for here)."""
    for action in actions:
        incoming, outgoing = messages(action, p, chunks)
        if incoming is not None:
            program.wait(program.post(_link(incoming), [Part("recv", incoming.sender, _payload(incoming))]))
        if outgoing is not None:
            sends.append(program.post(_link(outgoing), [Part("send", outgoing.receiver, _payload(outgoing))]))


def _groups(p: int) -> dict:
    links = {("link", kind, s, r): (s, r) for kind in ("activation", "gradient") for s in range(p) for r in range(p)
             if s != r}
    return {**links, "pp": tuple(range(p))}


def replay_synchronous(name: str, p: int, m: int, v: int, steps: int = 2) -> tuple[bool, list]:
    """`steps` training steps of a synchronous schedule: the executor's barrier, its actions, its
    wait for the sends, the idle fraction's all-reduce; then the trainer's loss all-reduce."""
    programs = {r: _Program(r) for r in range(p)}
    schedule = build(name, p, m, v)
    for step in range(steps):
        for r, program in programs.items():
            sends = []
            program.wait(program.collective("pp", f"barrier {step}"))
            _run_actions(program, schedule[r], p, p * v, sends)
            for op_id in sends:
                program.wait(op_id)
            program.wait(program.collective("pp", f"idle {step}"))
            program.wait(program.collective("pp", f"loss {step}"))
    return Replay({r: prog.steps for r, prog in programs.items()}, _groups(p)).run()


def replay_asynchronous(p: int, m: int, steps: int = 4) -> tuple[bool, list]:
    """The flushless schedules (2BW, PipeDream): each step's segment, the sums all-reduced in the
    background and waited for a step later, the sends waited for only when the pipeline drains
    (after the last step)."""
    programs = {r: _Program(r) for r in range(p)}
    for r, program in programs.items():
        sends, pending = [], None
        for step in range(steps):
            actions = segment(p, m, r, step, fill=step == 0, stop=steps * m)
            _run_actions(program, actions, p, p, sends)
            if step == steps - 1:
                for op_id in sends:
                    program.wait(op_id)
            sums = program.collective("pp", f"sums {step}")
            if pending is not None:
                program.wait(pending)
            pending = sums
        program.wait(pending)
    return Replay({r: prog.steps for r, prog in programs.items()}, _groups(p)).run()


SYNCHRONOUS = [name for name, spec in SCHEDULES.items() if not spec.asynchronous]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_every_synchronous_schedule_runs_to_the_end_under_nccls_rules_with_every_message_matched(p):
    for name in SYNCHRONOUS:
        for v in ((2, 3, 4) if SCHEDULES[name].virtual_stages else (1,)):
            # every m up to three rounds of p (past them a schedule repeats itself; 2p + 1 for p = 8)
            for m in range(1, (2 if p == 8 else 3) * p + 2):
                finished, mismatched = replay_synchronous(name, p, m, v)
                assert finished and not mismatched, (name, p, m, v, mismatched[:3])


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_flushless_schedules_run_to_the_end_under_nccls_rules_with_every_message_matched(p):
    for m in range(1, 2 * p + 2):
        finished, mismatched = replay_asynchronous(p, m)
        assert finished and not mismatched, (p, m, mismatched[:3])


# --- the design before the links, replayed: the model catches what issue 50 found --------------------------
def replay_one_group(name: str, p: int, m: int, v: int, device_synchronize: bool = False,
                     asynchronous_steps: int = 0) -> tuple[bool, list]:
    """Every message on the pipeline group "pp"; sends queued and posted in one batch with the
    next receive (or alone when the next action receives nothing); the batch's one handle waited
    for. device_synchronize: a step ends with a wait for everything posted (torch.cuda.synchronize)."""
    programs = {r: _Program(r) for r in range(p)}
    for r, program in programs.items():
        sends: list[int] = []
        posted: list[int] = []
        steps = asynchronous_steps or 1
        for step in range(steps):
            actions = segment(p, m, r, step, step == 0, steps * m) if asynchronous_steps else build(name, p, m, v)[r]
            queued: list[Part] = []
            for n, action in enumerate(actions):
                incoming, outgoing = messages(action, p, p * v)
                if incoming is not None:
                    op = program.post("pp", queued + [Part("recv", incoming.sender, _payload(incoming))])
                    posted.append(op)
                    program.wait(op)
                    queued = []
                if outgoing is not None:
                    queued.append(Part("send", outgoing.receiver, _payload(outgoing)))
                following = actions[n + 1] if n + 1 < len(actions) else None
                if queued and (following is None or messages(following, p, p * v)[0] is None):
                    sends.append(program.post("pp", queued))
                    posted.append(sends[-1])
                    queued = []
            if not asynchronous_steps or step == steps - 1:
                for op_id in sends:
                    program.wait(op_id)
            posted.append(program.collective("pp", f"step end {step}"))
            if device_synchronize:
                for op_id in posted:
                    program.wait(op_id)
    return Replay({r: prog.steps for r, prog in programs.items()}, _groups(p)).run()


def test_the_one_group_design_hangs_or_mixes_messages_where_issue_50_found_it():
    # interleaved 1F1B on 2 stages at m = 4 and 6 stopped; at m = p it ran
    for m in (4, 6):
        finished, mismatched = replay_one_group("interleaved", 2, m, 2)
        assert not finished or mismatched, m
    assert replay_one_group("interleaved", 2, 2, 2) == (True, [])
    # with an odd m, an activation and a gradient of the same shape can trade places
    assert any(not finished or mismatched for finished, mismatched in
               (replay_one_group("interleaved", 2, m, 2) for m in (3, 5, 7)))
    # 2BW / PipeDream: a run-ahead send, then a device-wide synchronize at the step's end
    finished, _ = replay_one_group("2bw", 2, 4, 1, device_synchronize=True, asynchronous_steps=3)
    assert not finished
    # the same programs on the links run through
    assert replay_synchronous("interleaved", 2, 4, 2) == (True, [])
    assert replay_asynchronous(2, 4) == (True, [])
