"""A static check of NCCL's device rule: in the runtime code, no tensor made without a device (on the
host, on a GPU machine) reaches a collective or a point-to-point operation, and nothing waits for
the whole device where the stream would do. gloo takes host tensors and the CPU run cannot tell
host from device, so without this the next `torch.tensor([...])` handed to a device group would
first fail on a GPU cluster (as `PipelineExecutor._measure_idle`'s did).

Within each function, a name is host-made when it is assigned a torch factory called without
device= (torch.tensor, torch.zeros, ...), or a method chain on such a value or name (.double(),
.view(...), .new_empty(...): they keep the device), unless the chain moves it (.to(...), .cuda());
a communication call (strata's comm, or torch.distributed's collectives and point-to-point
operations) must not take a host-made name or expression among its arguments."""

from __future__ import annotations

import ast
import pathlib

import pytest

STRATA = pathlib.Path(__file__).resolve().parent.parent / "strata"
RUNTIME = ("parallel", "train", "distributed", "memory", "infer", "tools")
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "rand", "randn",
             "randint", "eye", "from_numpy"}
MOVES = {"to", "cuda", "pin_memory"}  # a method that gives the tensor a device of its caller's choice
COMM = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_uneven", "broadcast", "send_recv"}
DIST = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
        "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "send", "recv", "isend", "irecv",
        "all_to_all_single", "P2POp", "reduce", "gather", "scatter"}


def _is_factory_without_device(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" \
        and node.func.attr in FACTORIES and (node.func.attr == "from_numpy"
                                             or not any(k.arg == "device" for k in node.keywords))


def _host_made(node: ast.AST, tainted: set[str]) -> bool:
    """Whether an expression's value is on the host: a factory without a device, a tainted name,
    or a method chain on either that does not move it."""
    if _is_factory_without_device(node):
        return True
    if isinstance(node, ast.Name):
        return node.id in tainted
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in MOVES:
            return False
        return _host_made(node.func.value, tainted)
    if isinstance(node, (ast.Subscript, ast.Attribute)):
        return _host_made(node.value, tainted)
    return False


def _is_communication(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        if func.value.id == "comm" and func.attr in COMM:
            return f"comm.{func.attr}"
        if func.value.id == "dist" and func.attr in DIST:
            return f"dist.{func.attr}"
    return None


def findings(source: str, filename: str = "<source>") -> list[str]:
    """'file:line: op takes host-made X' for every host tensor reaching a communication call, and
    'file:line: device-wide synchronize' for every torch.cuda.synchronize()."""
    found = []
    tree = ast.parse(source, filename)
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        tainted: set[str] = set()
        body = sorted((n for n in ast.walk(function) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.Call))),
                      key=lambda n: (n.lineno, n.col_offset))
        for node in body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in (t.id for t in ast.walk(target) if isinstance(t, ast.Name)):
                        if _host_made(node.value, tainted):
                            tainted.add(name)
                        else:
                            tainted.discard(name)
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr == "synchronize" and \
                        isinstance(func.value, ast.Attribute) and func.value.attr == "cuda":
                    found.append(f"{filename}:{node.lineno}: device-wide synchronize (use "
                                 f"strata.distributed.timing.synchronize_stream)")
                op = _is_communication(node)
                if op is None:
                    continue
                for argument in [*node.args, *(k.value for k in node.keywords)]:
                    for part in ast.walk(argument):
                        if _host_made(part, tainted):
                            found.append(f"{filename}:{node.lineno}: {op} takes a host-made tensor "
                                         f"({ast.unparse(part)})")
                            break
    return sorted(set(found))


def _runtime_files() -> list[pathlib.Path]:
    return sorted(p for package in RUNTIME for p in (STRATA / package).rglob("*.py"))


def test_the_runtime_hands_no_host_made_tensor_to_a_device_collective_and_never_syncs_the_whole_device():
    problems = [line for path in _runtime_files()
                for line in findings(path.read_text(), str(path.relative_to(STRATA.parent)))]
    assert problems == []


# The idle fraction's all-reduce as it was (strata/parallel/pipeline/executor.py before issue 50):
# the first step of any pipeline with pp > 1 on NCCL would have stopped on it.
MEASURE_IDLE_BEFORE = '''
def _measure_idle(self) -> None:
    busy = sum(t.end - t.start for t in self.timeline)
    span = torch.tensor([self.timeline[-1].end if self.timeline else 0.0], dtype=torch.float64)
    comm.all_reduce(span, self.group, GROUP, op=dist.ReduceOp.MAX)
    self.idle_fraction = 1 - busy / span.item() if span.item() > 0 else 0.0
'''


@pytest.mark.parametrize("source,caught", [
    (MEASURE_IDLE_BEFORE, "comm.all_reduce takes a host-made tensor (span)"),
    ("def f(g):\n    comm.all_reduce(torch.zeros(3), g, 'dp')\n", "comm.all_reduce takes a host-made tensor"),
    ("def f(g):\n    x = torch.tensor([1.0]).double()\n    y = x.view(1)\n    dist.all_reduce(y, group=g)\n",
     "dist.all_reduce takes a host-made tensor (y)"),
    ("def f(g, p):\n    b = torch.empty(4)\n    comm.send_recv([], [(b, p)], g, 'pp')\n", "comm.send_recv takes"),
    ("def f(d):\n    torch.cuda.synchronize(d)\n", "device-wide synchronize"),
])
def test_the_check_catches_a_host_made_tensor_on_its_way_to_a_collective(source, caught):
    assert any(caught in line for line in findings(source)), findings(source)


@pytest.mark.parametrize("source", [
    "def f(g, d):\n    span = torch.tensor([1.0], device=d)\n    comm.all_reduce(span, g, 'pp')\n",
    "def f(g, d):\n    x = torch.zeros(3).to(d)\n    comm.all_reduce(x, g, 'dp')\n",
    "def f(g, d):\n    x = torch.zeros(3)\n    x = torch.ones(3, device=d)\n    comm.all_reduce(x, g, 'dp')\n",
    "def f(d):\n    torch.cuda.current_stream(d).synchronize()\n",
])
def test_the_check_lets_device_tensors_and_stream_waits_through(source):
    assert findings(source) == []
