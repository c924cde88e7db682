"""The package's one way to build C++: ``torch.utils.cpp_extension.load``, on first use, with
the machine's compiler.

Every C++ source of the package goes through it: the CPU kernels and the shared-memory
barrier of this package and ZeRO-Offload's host AdamW (parallel/zero/host_kernel.py), each
plain C++ with ``extern "C"`` functions and no torch headers (a build of seconds, where
``<torch/extension.h>`` alone takes most of a minute), loaded with ``ctypes``. Why torch's
builder: it keeps a build per name under torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), rebuilds when a source or a
flag changes, and holds a lock file while it builds, so the ranks of a job that start at once
build once (DeepSpeed's op builders load their CPU ops the same way,
deepspeed/ops/op_builder/builder.py ``jit_load``). build_dir.py guards that lock file with an
flock that dies with its holder, and never loads from a directory another user could write.

Where there is no compiler or the build fails, ``Build.get`` logs one line and returns None;
the callers then run torch's operators (or gloo) instead, with the same results.
"""

import atexit
import ctypes
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch._appdirs import user_cache_dir

from trainer3d.cpu.build_dir import held as build_lock
from trainer3d.cpu.build_dir import unsafe as build_dir_unsafe

log = logging.getLogger(__name__)


def compiler() -> Optional[str]:
    """The C++ compiler: ``$CXX``, else ``c++``, where it is on PATH (torch's builder reads the same)."""
    return shutil.which(os.environ.get("CXX", "c++"))


STAMP_NAME = "trainer3d.built"
"""The record of a finished build in its directory: what it was built from (``build_key``) and
the library it left."""


def build_key(source: Path, flags: List[str], ldflags: List[str]) -> str:
    """What a build depends on, as a digest: the source's text, the flags, the compiler, and the
    torch and Python it was built for (torch's builder adds its own flags and libraries). A
    header the source includes from the system is not in it: after a compiler or library
    upgrade that keeps the compiler's path, delete the build directory to rebuild."""
    digest = hashlib.sha256(source.read_bytes())
    for part in (*flags, "|", *ldflags, str(compiler()), torch.__version__,
                 os.path.dirname(torch.__file__), sys.version):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()


def _identity(path: str) -> str:
    """A library file's identity: a rebuild (by any builder, one that keeps no stamp too)
    replaces the file and changes it."""
    st = os.stat(path)
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns}"


def _built(build_dir: Path, key: str) -> Optional[str]:
    """The library a finished build of ``key`` left in ``build_dir``, unchanged since, or None."""
    try:
        found, path, identity = (build_dir / STAMP_NAME).read_text().split("\n")
        unchanged = _identity(path) == identity
    except (OSError, ValueError):
        return None
    return path if found == key and Path(path).parent == build_dir and unchanged else None


def build_directory(name: str) -> Path:
    """Where ``name`` is built: the directory torch's builder would choose
    (torch/utils/cpp_extension.py ``_get_build_directory``: ``TORCH_EXTENSIONS_DIR``, else a
    folder per Python and accelerator in the user's cache), found without importing the builder,
    which imports setuptools: a process that loads a finished build never needs it
    (tests/unit/test_cpu_build.py holds the two directories equal)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(user_cache_dir(appname="torch_extensions")), f"{python}_{accelerator}")
    return Path(root) / name


def cpp_extension_load(name: str, source: Path, flags: List[str]) -> str:
    """``torch.utils.cpp_extension.load`` of one source: the path of the shared library it built.

    A build this machine finished already is loaded straight from its directory: torch's
    ``load`` in a fresh process rewrites its ninja file and starts the compiler and ninja to find
    nothing to do (seconds per rank on a busy host, paid by every rank of every job); the stamp
    of a finished build (``STAMP_NAME``) says which library answers ``build_key``."""
    if compiler() is None:
        raise RuntimeError("no C++ compiler (c++ or $CXX) on PATH")
    ldflags = ["-fopenmp"] if "-fopenmp" in flags else []
    key = build_key(source, flags, ldflags)
    build_dir = build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    why = build_dir_unsafe(build_dir)
    if why:
        # Not this user's alone: what it holds is not loaded, and not built on either.
        private = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        log.warning("%s: %s; building into the private directory %s instead (make the extensions "
                    "directory, TORCH_EXTENSIONS_DIR, yours and not writable by others to keep one build)",
                    name, why, private)
        build_dir = private
        atexit.register(shutil.rmtree, private, ignore_errors=True)  # loaded libraries stay mapped
    with build_lock(build_dir, shared=True):  # no builder replaces the library while it loads
        built = _built(build_dir, key)
        if built:
            return built
    with build_lock(build_dir):
        return _build(name, source, flags, ldflags, build_dir, key)


def _build(name: str, source: Path, flags: List[str], ldflags: List[str], build_dir: Path, key: str) -> str:
    """``cpp_extension.load`` under the build lock, and the stamp of what it built."""
    # Here, not at the top: torch's builder imports setuptools, which only a build needs.
    from torch.utils import cpp_extension

    built = _built(build_dir, key)  # by another process while this one waited for the lock
    if built:
        return built
    (build_dir / STAMP_NAME).unlink(missing_ok=True)
    # ninja (a dependency) installs its binary beside this interpreter, which a venv used
    # without activating has off PATH; torch's build looks for it on PATH.
    path = os.environ.get("PATH", "")
    scripts = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and scripts:
        os.environ["PATH"] = scripts + os.pathsep + path
    try:
        library = cpp_extension.load(name, [str(source)], extra_cflags=flags, extra_ldflags=ldflags,
                                     build_directory=str(build_dir), is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path
    stamp = build_dir / f"{STAMP_NAME}.{os.getpid()}"
    stamp.write_text(f"{key}\n{library}\n{_identity(library)}")
    os.replace(stamp, build_dir / STAMP_NAME)  # whole or absent to a reader
    return library


class Build:
    """One source built once per process (and cached across processes), or None after one
    logged line saying why and what runs instead (``fallback``).

    ``load`` turns the built library's path into what callers use, and raises where
    it is unfit (an ABI that does not match this module, a CPU the kernel was not written for);
    ``unfit``, asked before building, says why this machine cannot use it at all, or None.
    """

    def __init__(self, name: str, source: Path, flags: List[str], what: str, fallback: str,
                 load: Callable[[str], Any], unfit: Optional[Callable[[], Optional[str]]] = None):
        self.name, self.source, self.flags = name, source, list(flags)
        self.what, self.fallback, self._load = what, fallback, load
        self.unfit = unfit
        self._value: Optional[Any] = None
        self._tried = False

    def get(self) -> Optional[Any]:
        if not self._tried:
            self._tried = True
            try:
                why = self.unfit() if self.unfit is not None else None
                if why:
                    raise RuntimeError(why)
                self._value = self._load(cpp_extension_load(self.name, self.source, self.flags))
            except Exception as e:  # any build or load failure leaves the caller's fall-back in place
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                log.warning("%s: %s: %s; %s", self.what, type(e).__name__, first, self.fallback)
                self._value = None
        return self._value


def c_library(abi_symbol: str, abi: int, signatures: Dict[str, tuple]) -> Callable[[str], ctypes.CDLL]:
    """A ``Build.load`` for plain C++ sources: the built library through ``ctypes``, its
    ``abi_symbol()`` checked against ``abi`` (a module and a build from different versions
    never pair up) and each function of ``signatures`` (name: (argument types, result type)) typed."""

    def load(path: str) -> ctypes.CDLL:
        lib = ctypes.CDLL(path)
        found = getattr(lib, abi_symbol)()
        if found != abi:
            raise RuntimeError(f"the built library speaks ABI {found}, this module {abi}")
        for name, (args, result) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
        return lib

    return load
