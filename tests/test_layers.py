"""strata's packages import downward only (docs/architecture.md, "Layers"), never in a cycle, and
import strata modules at the top of the file, where the graph can be read."""

import ast
import os
from collections import defaultdict

import strata

ROOT = os.path.dirname(strata.__file__)

# Lowest first. A module may import from its own layer and the layers below; a module belongs to
# the layer of the longest prefix that names it.
LAYERS = [
    ("errors", ("strata.errors", "strata.files")),
    ("facts", ("strata.model.config", "strata.model.shape_checks", "strata.model.presets", "strata.plan.hardware")),
    ("rules", ("strata.rules", "strata.config", "strata.config_file")),
    ("model", ("strata.model",)),
    ("plan", ("strata.plan",)),
    ("distributed", ("strata.distributed",)),
    ("checkpoint, data, memory", ("strata.checkpoint", "strata.data", "strata.memory")),
    ("parallel", ("strata.parallel",)),
    ("train, infer", ("strata.train", "strata.infer")),
    ("tools", ("strata.tools",)),
    ("cli", ("strata.cli", "strata.demo", "strata.__main__")),
]
# Where a function may import a strata module: the CLI's handlers import the engine only when they
# run, so that parsing flags and `--help` never import torch.
LAZY_IMPORTS_ALLOWED = ("strata.cli",)


def _modules() -> dict[str, str]:
    """module name -> file path, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> int:
    best, rank = "", None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, index
    assert rank is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return rank


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported strata module, imported inside a function) for each strata import of a module."""
    tree = ast.parse(open(MODULES[module]).read())
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names if a.name.startswith("strata"))
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("strata"):
                for alias in child.names:  # `from strata.checkpoint import store` imports a module
                    target = f"{child.module}.{alias.name}"
                    found.append((target if target in MODULES else child.module, in_function))
            visit(child, inner)
    visit(tree, False)
    return found


def test_every_import_goes_down_the_layers():
    upward = []
    for module in MODULES:
        for target, _ in _imports(module):
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = defaultdict(set)
    for module in MODULES:
        for target, _ in _imports(module):
            if target != module and not module.startswith(target + "."):  # a package's own __init__
                graph[module].add(target)
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"
    for module in sorted(MODULES):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_strata_modules_are_imported_at_the_top_of_the_file():
    lazy = [f"{module} imports {target} inside a function" for module in MODULES
            if not module.startswith(LAZY_IMPORTS_ALLOWED)
            for target, in_function in _imports(module) if in_function]
    assert not lazy, "\n".join(lazy)


def test_the_layers_are_the_ones_the_architecture_document_shows():
    doc = open(os.path.join(os.path.dirname(ROOT), "docs", "architecture.md")).read()
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            assert prefix.removeprefix("strata.").replace(".", "/") in doc, (name, prefix)


# --- a model family's layout is known only to its description ------------------------------------
# Words of parameter paths that say nothing about a layout (containers, leaves).
GENERIC_PATH_WORDS = {"weight", "bias", "model", "layers", "transformer", "h", "norm"}  # norm: a config field too
# Outside strata/model (the model and its families) no module names a family's layer.
LAYOUT_FREE = ("strata/parallel", "strata/train", "strata/plan", "strata/checkpoint", "strata/memory",
               "strata/infer", "strata/tools", "strata/rules", "strata/data", "strata/distributed", "strata/cli")


def _family_path_words() -> set[str]:
    """Every word of every parameter path of every family, in strata's names and in Hugging Face's."""
    from strata.model.config import ModelConfig
    from strata.model.families import FAMILIES
    from strata.model.presets import PRESETS
    from strata.model.transformer import build_model
    words = set()
    for family in FAMILIES.values():
        shapes = [c for c in PRESETS.values() if c.family == family.name] or [PRESETS["tiny"]]
        for preset in shapes:
            cfg = ModelConfig.from_dict({**preset.to_dict(), "vocab_size": 8, "n_layers": 1, "d_model": 8,
                                         "n_heads": 2, "n_kv_heads": None, "d_head": None, "d_ff": 8,
                                         "max_seq_len": 8, "qk_norm": family.name == "qwen3"})
            state = build_model(cfg, seed=None).state_dict()  # on the meta device
            names = list(state) + (list(family.tensors_to_hf(state, cfg, None)) if family.converts else [])
            words |= {word for name in names for word in name.split(".") if not word.isdigit()}
    return words - GENERIC_PATH_WORDS


def test_no_module_outside_the_model_names_a_family_layer():
    words = _family_path_words()
    assert {"embed", "blocks", "head", "wq", "w_down", "q_norm", "lm_head", "q_proj", "c_attn"} <= words
    offenders = []
    for module, path in MODULES.items():
        if not path.replace(os.sep, "/").split("/strata/", 1)[-1].startswith(tuple(p[7:] for p in LAYOUT_FREE)):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Attribute) and node.attr in words:
                offenders.append(f"{module}:{node.lineno} .{node.attr}")
            is_path = isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.replace(".", "").replace("_", "").isalnum()
            if is_path and set(node.value.split(".")) & words:
                offenders.append(f"{module}:{node.lineno} {node.value!r}")
    assert not offenders, offenders


MAX_FILE_LINES = 450  # a file past it holds two things: split it where they part
MAX_TRAINING_FUNCTION_LINES = 50  # strata/train's steps read top to bottom in one screen


def test_no_file_is_over_450_lines_and_no_training_function_over_50():
    long_files, long_functions = [], []
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                source = f.read()
            relative = os.path.relpath(path, os.path.dirname(ROOT))
            if source.count("\n") > MAX_FILE_LINES:
                long_files.append(f"{relative}: {source.count(chr(10))} lines")
            if os.path.basename(folder) == "train":
                long_functions += [f"{relative}: {node.name} is {node.end_lineno - node.lineno + 1} lines"
                                   for node in ast.walk(ast.parse(source))
                                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                                   and node.end_lineno - node.lineno + 1 > MAX_TRAINING_FUNCTION_LINES]
    assert not long_files and not long_functions, long_files + long_functions
