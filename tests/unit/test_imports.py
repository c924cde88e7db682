"""The import graph of trainer3d/ and tools/, read from the source (no imports run): no
cycles, and no imports hidden inside functions except the few listed with their reason."""

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

from tests.conftest import ROOT

# (module, what it imports inside a function): why it is not at the top.
DEFERRED = {
    ("trainer3d.observe.loggers", "wandb"): "optional sink, slow to import: only runs with logger=wandb pay for it",
    ("trainer3d.observe.loggers", "torch.utils.tensorboard"): "optional sink: only runs with logger=tensorboard need it",
    ("tools.bench.offload", "deepspeed.ops.adam"): "the optional peer (the peers extra), measured only where installed",
    ("trainer3d.cpu.build", "torch.utils"): "the compiler driver, needed only where a C++ source is first "
    "built (the CPU kernels, the shared-memory barrier, the host AdamW kernel)",
}
DEFERRED_MODULES = {  # every import of the module may sit in a function, for the reason given
    "tools.bench.hotpath": "imports trainer3d from the revision it measures, put on sys.path at run time",
    "tools.bench.host_overhead": "imports trainer3d from the revision it measures (--against), put on sys.path at run time",
    "tools.bench.deepspeed_pair": "imports trainer3d from the revision it measures (--against) and the optional deepspeed "
                                  "in the ranks it starts",
}


def _modules() -> Dict[str, Path]:
    out = {}
    for path in [*(ROOT / "trainer3d").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.Module, modules: Dict[str, Path]) -> List[Tuple[ast.AST, List[str]]]:
    """Every import statement and the modules it names (``from pkg import submodule`` names
    the submodule; ``from module import name`` the module)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.append((node, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node, [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                               for a in node.names]))
    return out


def _graph() -> Tuple[Dict[str, Set[str]], Set[Tuple[str, str]]]:
    modules = _modules()
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    deferred = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node, targets in _imports(tree, modules):
            edges[name] |= {t for t in targets if t in modules and t != name}
            if id(node) not in top:
                deferred |= {(name, t) for t in targets}
    return edges, deferred


def _cycle(edges: Dict[str, Set[str]]) -> List[str]:
    """One import cycle, or [] (depth-first search for a back edge)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return []

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_cycles():
    edges, _ = _graph()
    assert "trainer3d.parallel.zero.flat" in edges and edges["trainer3d.train"], "the scan must see the package"
    assert _cycle(edges) == []


def test_no_imports_hidden_in_functions_but_the_listed_ones():
    _, deferred = _graph()
    deferred = {(module, target) for module, target in deferred if module not in DEFERRED_MODULES}
    assert deferred <= DEFERRED.keys(), sorted(deferred - DEFERRED.keys())


def test_the_scan_finds_a_cycle_and_a_deferred_import():
    """The checks above can fail: a planted cycle and a planted function-level import are seen."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    tree = ast.parse("import os\n\ndef f():\n    import trainer3d.job.launch\n")
    top = {id(n) for n in tree.body}
    hidden = [t for node, targets in _imports(tree, _modules()) if id(node) not in top for t in targets]
    assert hidden == ["trainer3d.job.launch"]


def test_the_cpu_speed_work_is_walled_off():
    """The model's math names no kernel library (model/functional.py imports torch alone; the
    CPU kernels register themselves from trainer3d/cpu/), and trainer3d/cpu/ reaches down to
    the model only, never up into the engine that uses it."""
    edges, _ = _graph()
    assert {t for t in edges["trainer3d.model.functional"] if t.startswith("trainer3d")} == set()
    assert not [(m, t) for m in edges if m.startswith("trainer3d.model") for t in edges[m]
                if t.startswith("trainer3d.cpu")]
    cpu = {m for m in edges if m == "trainer3d.cpu" or m.startswith("trainer3d.cpu.")}
    assert cpu >= {"trainer3d.cpu.ops", "trainer3d.cpu.shm", "trainer3d.cpu.build"}
    up = {(m, t) for m in cpu for t in edges[m] if not t.startswith(("trainer3d.cpu", "trainer3d.model"))}
    assert up == set(), sorted(up)
