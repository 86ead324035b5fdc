"""The mesh owns the process groups and the ranks' coordinates (issue 52): no module of strata
other than strata/distributed/mesh.py creates a process group or computes where a rank sits
from its number and the layout's degrees. A static check of the source, so that the next
`new_group` or `rank % tp` outside the mesh fails here, before its groups are created in a
different order on some rank (a hang) or its arithmetic disagrees with the mesh's rank order."""

from __future__ import annotations

import ast
import pathlib

STRATA = pathlib.Path(__file__).resolve().parent.parent / "strata"
MESH = STRATA / "distributed" / "mesh.py"
# torch.distributed's ways to make a group, and DeviceMesh's
MAKES_GROUPS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_device_mesh", "DeviceMesh"}
DEGREES = {"dp", "cp", "tp", "pp", "ep", "world_size", "replicas"}  # what a coordinate divides a rank by


def _names(node: ast.AST) -> set[str]:
    """Every name and attribute mentioned in an expression (get_rank() mentions "get_rank")."""
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
    return found


def violations(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in MAKES_GROUPS:
                found.append(f"{where}:{node.lineno}: {name}() makes a process group outside the mesh")
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.FloorDiv)):
            ranks = {n for n in _names(node.left) if n in ("rank", "get_rank") or n.endswith("_rank")}  # not "ranks"
            if ranks and _names(node.right) & DEGREES:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} computes a rank's coordinate outside "
                             f"the mesh (use Mesh.coordinate / ParallelDims.coordinates)")
    return found


def test_no_module_but_the_mesh_makes_a_process_group_or_computes_a_ranks_coordinates():
    found = [v for path in sorted(STRATA.rglob("*.py")) if path != MESH
             for v in violations(path.read_text(encoding="utf-8"), str(path.relative_to(STRATA.parent)))]
    assert not found, "\n".join(found)


def test_the_check_catches_what_the_trainer_and_the_pipeline_stage_used_to_do():
    """The code this check replaced: the trainer's save group and tp coordinate, the stage's
    embedding groups, calibration's groups of adjacent ranks."""
    old = '''
group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout))
grid_groups = GridGroups(grid, rank % dims.tp, axes)
groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
mine, _ = dist.new_subgroups_by_enumeration(everywhere)
where = dist.get_rank() // (self.cp * self.tp) % self.dp
'''
    assert {v.split(":")[1] for v in violations(old, "old")} == {"2", "3", "4", "5", "6"}  # one a line
    fine = '''
neighbour = (rank + 1) % n
heads = range(self.rank * q_per_rank // q_per_kv, 3)
tp_rank = mesh.coordinate("tp")
'''
    assert violations(fine, "fine") == []
