"""The import graph of trainer3d/ and tools/, read from the source (no imports run): no
cycles between modules, the packages stacked one way (``MAY_IMPORT``, what each top-level unit
of trainer3d may import, as import-linter's layers contract would hold it), each package's
``__init__`` saying the same, and no imports hidden inside functions except the few listed
with their reason."""

import ast
import re
from pathlib import Path
from typing import Dict, Iterable, List, Set, Tuple

from tests.conftest import ROOT

# (module, what it imports inside a function): why it is not at the top.
DEFERRED = {
    ("trainer3d.observe.loggers", "wandb"): "optional sink, slow to import: only runs with logger=wandb pay for it",
    ("trainer3d.observe.loggers", "torch.utils.tensorboard"): "optional sink: only runs with logger=tensorboard need it",
    ("tools.bench.offload", "deepspeed.ops.adam"): "the optional peer (the peers extra), measured only where installed",
    ("trainer3d.trainer", "trainer3d.parallel.pipeline.schedule"): "torch.distributed.pipelining imports "
    "torch._dynamo, 1-2 s of CPU at every rank's and launcher's start: only pp > 1 builds a schedule",
    ("trainer3d.parallel.pipeline.receive_count", "torch.distributed.pipelining"): "as above: only an interleaved "
    "pp layout's memory count walks torch's schedule; the planner and every rank import the count",
    ("trainer3d.parallel.pipeline.receive_count", "torch.distributed.pipelining.schedules"): "the same",
    ("trainer3d.parallel.pipeline.timeline", "torch.distributed.pipelining"): "as above: only a zero-bubble or "
    "interleaved layout's bubble and memory walk torch's action lists; the planner imports the timeline",
    ("trainer3d.model.documents", "torch.nn.attention.flex_attention"): "imports torch._dynamo, 1-2 s of CPU at "
    "every rank's start: only data.document_mask on CUDA (and its tests) runs FlexAttention",
    ("trainer3d.cpu.build", "torch.utils"): "the compiler driver, needed only where a C++ source is first "
    "built (the CPU kernels, the shared-memory barrier, the host AdamW kernel)",
    ("trainer3d", "torch"): "only a torch without package metadata (a source tree on PYTHONPATH) is asked its "
    "version by importing it; the installed distribution's metadata answers without torch's 2-3 s of CPU",
    ("trainer3d.config.device", "torch"): "validate imports the device rules, so the submitting process does; "
    "torch (2-3 s of CPU) only where a GPU count decides something, and in a rank",
    ("trainer3d.checkpoint.metadata", "torch"): "the same as its DCP imports: only reading a checkpoint's metadata, "
    "whose pickle names torch's classes",
    ("trainer3d.preflight.refusal", "trainer3d.preflight.memory_check"): "the estimate builds a block on the "
    "meta device (torch): only a run past the config, resume and device checks, with the check on",
    ("trainer3d.train", "trainer3d.memory.dry_run"): "builds the model on the meta device (torch): only dry_run=true",
    ("trainer3d.train", "trainer3d.hf.check"): "reads a Hugging Face checkpoint with torch's dtypes (hf/mapping.py): "
    "only model.init_from runs",
    ("trainer3d.rank.task", "trainer3d.rank.body"): "the launcher imports TrainTask's module to pickle it; "
    "only a rank runs the body, which imports torch (2-3 s of CPU), the loop and the planner",
    ("trainer3d.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"): "DCP imports DTensor and "
    "sympy: only reading a checkpoint's metadata needs its classes; the launcher lists checkpoints",
    ("trainer3d.checkpoint.metadata", "torch.distributed.checkpoint.metadata"): "the same (and a type hint)",
    ("trainer3d.parallel.zero.fsdp", "torch.distributed.fsdp"): "imports DTensor and sympy: only ZeRO-2/3 "
    "shards with FSDP2; every rank, the launcher and the planner import the module",
    ("trainer3d.data.sources", "trainer3d.data.chat_sample"): "imports jinja2 and tokenizers: only data=chat_sample "
    "uses them; every rank and the launcher import the sources",
}
DEFERRED_MODULES = {  # every import of the module may sit in a function, for the reason given
    "tools.bench.hotpath": "imports trainer3d from the revision it measures, put on sys.path at run time",
    "tools.bench.host_overhead": "imports trainer3d from the revision it measures (--against), put on sys.path at run time",
    "tools.bench.deepspeed_pair": "imports trainer3d from the revision it measures (--against) and the optional deepspeed "
                                  "in the ranks it starts",
}


# What each top-level unit of trainer3d (a package, a root module; "trainer3d" is the root
# __init__) may import of the others, from the top of the stack down: docs/code.md argues the
# floors.
MAY_IMPORT: Dict[str, Set[str]] = {
    "train": {"launch", "rank", "preflight", "checkpoint", "memory", "hf", "config"},  # the entry point
    "tools": {"plan", "parallel", "checkpoint", "hf", "data", "model", "config"},  # the user tools (gpu_check runs the planner; plot_schedule draws the pipeline's action lists)
    "launch": {"rank", "config"},  # the submitting process
    "rank": {"trainer", "plan", "checkpoint", "observe", "parallel", "cpu", "config"},  # the rank's process
    "trainer": {"checkpoint", "observe", "parallel", "optim", "data", "model", "config"},  # the loop
    "preflight": {"memory", "parallel", "data", "config"},  # checks before launch
    "plan": {"memory", "observe", "parallel", "model", "config"},
    "checkpoint": {"observe", "parallel", "optim", "hf", "model", "data", "config"},
    "memory": {"parallel", "model", "config"},
    "observe": {"parallel", "optim", "data", "model", "config"},
    "parallel": {"optim", "hf", "data", "cpu", "model", "config"},
    "optim": {"model", "config"},
    "hf": {"data", "model", "config"},
    "model": {"config"},
    "data": {"config"},
    "config": set(),
    "cpu": {"model"},  # CPU ranks' speed: the CPU kernels of the model's operators, shared-memory collectives
    "trainer3d": {"preflight"},  # the torch floor (preflight/requirements.py), checked on import
}
ROOT_MODULES = {"__init__", "train", "trainer"}
"""The package root holds the entry point and the loop."""


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


def _unit(module: str) -> str:
    """The top-level unit of trainer3d a module belongs to (``trainer3d`` for the root __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_edges(edges: Dict[str, Set[str]]) -> Dict[Tuple[str, str], List[str]]:
    """(unit, unit it imports) -> the module imports behind it, for trainer3d's modules only."""
    out: Dict[Tuple[str, str], List[str]] = {}
    for module, targets in edges.items():
        if not module.startswith("trainer3d"):
            continue
        for target in targets:
            pair = (_unit(module), _unit(target))
            if target.startswith("trainer3d") and pair[0] != pair[1]:
                out.setdefault(pair, []).append(f"{module} -> {target}")
    return out


def _violations(edges: Dict[str, Set[str]], table: Dict[str, Set[str]]) -> List[str]:
    """Each package-level import the table does not allow, with the module imports behind it."""
    return [f"{a} may not import {b}: {sorted(why)}" for (a, b), why in sorted(_package_edges(edges).items())
            if b not in table.get(a, set())]


def _floors(table: Dict[str, Set[str]]) -> Dict[str, int]:
    """Each unit's floor: 0 for one that imports nothing, else one above the highest it may
    import. Raises ValueError on a cycle in the table itself (no floors exist then)."""
    floors: Dict[str, int] = {}

    def floor(unit: str, seen: Tuple[str, ...]) -> int:
        if unit in seen:
            raise ValueError(f"the table is not one-way: {' -> '.join(seen[seen.index(unit):] + (unit,))}")
        if unit not in floors:
            floors[unit] = 1 + max((floor(b, seen + (unit,)) for b in table.get(unit, ())), default=-1)
        return floors[unit]

    for unit in table:
        floor(unit, ())
    return floors


def _may_import_sentence(docstring: str) -> Set[str]:
    """The units a package's ``__init__`` docstring says it may import: the names in double
    backticks of its one sentence ``May import ``a``, ``b`` and ``c``.`` (to its first full stop
    or semicolon), or none (``May import nothing of trainer3d.``)."""
    found = re.findall(r"May\s+import\s+(.+?)[.;](?:\s|$)", docstring, flags=re.S)
    assert len(found) == 1, f"one 'May import' sentence, found {len(found)}"
    return set(re.findall(r"``([a-z_0-9]+)``", found[0]))


def _units(root: Path) -> Iterable[str]:
    """The top-level units of the tree: packages and root modules (the root __init__ as ``trainer3d``)."""
    for path in (root / "trainer3d").iterdir():
        if path.is_dir() and (path / "__init__.py").is_file():
            yield path.name
        elif path.suffix == ".py":
            yield "trainer3d" if path.stem == "__init__" else path.stem


def test_packages_import_one_way_down_the_table():
    edges, _ = _graph()
    assert _package_edges(edges), "the scan must see imports between packages"
    assert _violations(edges, MAY_IMPORT) == []


def test_the_table_covers_every_unit_and_is_one_way():
    units = set(_units(ROOT))
    assert {"config", "launch", "rank", "preflight", "trainer", "train"} <= units
    assert units <= MAY_IMPORT.keys(), sorted(units - MAY_IMPORT.keys())
    assert all(allowed <= MAY_IMPORT.keys() for allowed in MAY_IMPORT.values())
    floors = _floors(MAY_IMPORT)
    assert floors["config"] < floors["model"] < floors["parallel"] < floors["trainer"] < floors["rank"] \
        < floors["launch"] < floors["train"]


def test_each_package_says_what_it_may_import_as_the_table_does():
    for unit in sorted(set(_units(ROOT))):
        init = ROOT / "trainer3d" / unit / "__init__.py"
        if not init.is_file():
            continue
        said = _may_import_sentence(ast.get_docstring(ast.parse(init.read_text())) or "")
        assert said == MAY_IMPORT[unit], f"trainer3d/{unit}/__init__.py says {sorted(said)}, the table {sorted(MAY_IMPORT[unit])}"


def test_the_loop_imports_no_planner():
    """trainer3d/trainer.py reaches no module of trainer3d/plan/, directly or through another:
    the rank's body hands it the planner's prediction (trainer3d/rank/task.py)."""
    edges, _ = _graph()
    seen, todo = set(), ["trainer3d.trainer"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(edges.get(module, ()))
    assert len(seen) > 50, "the scan must follow the loop's imports"
    assert sorted(m for m in seen if m.startswith("trainer3d.plan")) == []


def _reached(edges: Dict[str, Set[str]], start: Iterable[str]) -> Set[str]:
    """The modules of the tree ``start`` imports at their tops, directly or through another."""
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(edges.get(module, ()))
    return seen


def _importing(modules: Iterable[str], packages: Set[str]) -> List[str]:
    """``module -> package`` for each of ``modules`` whose top-level imports name one of
    ``packages`` (third-party: Hydra, OmegaConf)."""
    paths = _modules()
    found = []
    for module in sorted(modules):
        for node in ast.parse(paths[module].read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{module} -> {n}" for n in names if n.split(".")[0] in packages]
    return found


def test_a_rank_imports_no_hydra():
    """What a rank imports at the top of its modules, from submitit's task (trainer3d/rank/task.py,
    which unpickles the config) through its body (trainer3d/rank/body.py: the loop, the
    checkpoints, the planner's prediction), reaches neither Hydra nor OmegaConf: a rank composes
    nothing, and the schema's registration in Hydra's ConfigStore lives where the config is
    composed (trainer3d/config/composed.py, trainer3d/plan/composed.py). The entry point, which
    composes, does reach them (the scan sees a module's third-party imports)."""
    edges, _ = _graph()
    rank = _reached(edges, ["trainer3d.rank.task", "trainer3d.rank.body"])
    assert {"trainer3d.trainer", "trainer3d.plan.settings", "trainer3d.config.schema"} <= rank
    assert _importing(rank, {"hydra", "omegaconf"}) == []
    assert "trainer3d.config.composed -> hydra.core.config_store" in _importing(_reached(edges, ["trainer3d.train"]),
                                                                                {"hydra"})


def test_the_package_root_holds_only_the_entry_point_and_the_loop():
    root = {path.stem for path in (ROOT / "trainer3d").glob("*.py")}
    assert root <= ROOT_MODULES, sorted(root - ROOT_MODULES)


def test_the_package_checks_catch_a_planted_violation():
    """The checks above can fail: an import up the stack, a cycle in a table and a sentence that
    disagrees are each seen."""
    planted = {"trainer3d.config.validate": {"trainer3d.launch.slurm"}, "trainer3d.launch.slurm": set(),
               "trainer3d.data.loader": {"trainer3d.config.schema"}}
    assert _violations(planted, MAY_IMPORT) == ["config may not import launch: ['trainer3d.config.validate -> "
                                                "trainer3d.launch.slurm']"]
    try:
        _floors({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    except ValueError as err:
        assert "a -> b -> c -> a" in str(err)
    else:
        raise AssertionError("a cycle in the table must be refused")
    assert _floors({"top": {"mid", "low"}, "mid": {"low"}, "low": set()}) == {"top": 2, "mid": 1, "low": 0}
    assert _may_import_sentence("Owns x. May import ``config`` and ``model``; never ``job``.\n") == {"config", "model"}
    assert _may_import_sentence("Owns x. May import nothing of trainer3d.") == set()


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
    tree = ast.parse("import os\n\ndef f():\n    import trainer3d.launch.local\n")
    top = {id(n) for n in tree.body}
    hidden = [t for node, targets in _imports(tree, _modules()) if id(node) not in top for t in targets]
    assert hidden == ["trainer3d.launch.local"]


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
