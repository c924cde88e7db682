import ast
import compileall
import functools
import os
import py_compile
import signal
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
BYTECODE_TREES = ("trainer3d", "tests", "tools")
"""What ``pytest_configure`` compiles (the processes the suite starts import from these)."""

# Tests never talk to wandb's servers.
os.environ.setdefault("WANDB_MODE", "offline")

# Each xdist worker's share of the cores, for its own torch and every run it starts (read by
# torch at import and by the engine's ranks: trainer3d/rank/threads.py cpu_threads). A run
# taking every core beside the other worker's stalls at each OpenMP region while a thread of
# it waits for a core (a 20-step tiny run: 5 s on 1 thread, minutes on 2, beside one busy
# process).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


def pytest_configure(config):
    """The package's and the tests' bytecode, compiled once by the controlling process before
    any worker starts. Python writes a module's cache as it first imports it, unless
    ``PYTHONDONTWRITEBYTECODE`` is set (a CI runner may set it): then every fresh interpreter the
    suite starts (each run's submitting process, submitit's ranks, the tools, the forkservers)
    compiled the package's modules from source again. A cache that exists is read either way.
    Timestamp-checked, as Python writes them itself (py_compile would check hashes where
    ``SOURCE_DATE_EPOCH`` is set)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        for tree in BYTECODE_TREES:
            compileall.compile_dir(str(ROOT / tree), quiet=2, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    """A directory shared by a whole test session (cached reference runs), by all its workers
    under pytest-xdist (each worker's base temp is a child of the session's)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "session"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("session")
from tests.support.slurm_cluster import slurm_cluster, stop_after  # noqa: E402,F401  (session fixture)


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """The Slurm cluster stops after the last Slurm test (tests/support/slurm_cluster.py)."""
    stop_after(item)


def pytest_collection_modifyitems(config, items):
    """The slow tests first (the order is otherwise kept): on two xdist workers the long ones
    then start early, instead of one worker finishing a long test alone at the end. A file
    with a module fixture moves whole, where any of its tests is slow: split in two, its
    fixture would be set up twice (torn down when the file's first part ends)."""
    slow_files = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("slow")}

    def quick(item) -> bool:
        path = item.nodeid.split("::", 1)[0]
        if xdist_scope(path) and path in slow_files:
            return False
        return item.get_closest_marker("slow") is None

    items.sort(key=quick)


def _defines_module_fixture(path: Path) -> bool:
    """Whether the test file defines a fixture of module scope (set up once per file)."""
    for node in ast.walk(ast.parse(path.read_text())):
        for deco in getattr(node, "decorator_list", []):
            if isinstance(deco, ast.Call) and any(k.arg == "scope" and getattr(k.value, "value", None) == "module"
                                                  for k in deco.keywords):
                return True
    return False


@functools.lru_cache(maxsize=None)
def xdist_scope(path: str) -> str:
    """The unit of work an xdist worker takes for the tests of ``path`` (relative to the root):
    the whole tier for tests/slurm/ (they share the session's one cluster: a lost-node test
    restarts a node under any job running on it), the whole file where it defines a module
    fixture (which would otherwise run once per worker), else "" (each test a unit of its own).
    pytest-xdist's own marks (``xdist_group`` with ``--dist loadgroup``) stopped grouping on
    pytest 9.2: it renames node ids, which pytest no longer reads back
    (pytest-dev/pytest-xdist#1386)."""
    if path.startswith("tests/slurm/"):
        return "tests/slurm"
    full = ROOT / path
    return path if full.is_file() and _defines_module_fixture(full) else ""


class TierScheduling(LoadScopeScheduling):
    """``--dist loadgroup`` by ``xdist_scope``: grouped tests are one work unit, every other
    test a unit of its own."""

    def _split_scope(self, nodeid: str) -> str:
        return xdist_scope(nodeid.split("::", 1)[0]) or nodeid


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    return TierScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


_JOB_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _signals_as_a_fresh_process_has_them():
    """Every test starts with the job signals unblocked and handled as a fresh interpreter
    handles them, and leaves them so: a process a test starts (a submitit controller, a rank)
    inherits this process's blocked mask and ignored signals, and a controller that ignores
    SIGINT never ends on submitit's cancel."""
    def reset():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _JOB_SIGNALS)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in _JOB_SIGNALS[1:]:
            if signal.getsignal(sig) is signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
    reset()
    yield
    reset()
