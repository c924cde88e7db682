"""The package's one way to build C++: ``torch.utils.cpp_extension.load``, on first use, with
the machine's compiler.

Every C++ source of the package goes through it: the CPU kernels and the shared-memory
barrier of this package (plain C++ with ``extern "C"`` functions, loaded with ``ctypes``) and
ZeRO-Offload's host AdamW (parallel/zero/host_kernel.py, a torch extension module). Why
torch's builder for all three: the AdamW kernel needs torch's headers and ``at::parallel_for``,
which only it provides; it keeps a build per name under torch's extension directory
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
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from trainer3d.cpu.build_dir import held as build_lock
from trainer3d.cpu.build_dir import unsafe as build_dir_unsafe

log = logging.getLogger(__name__)


def compiler() -> Optional[str]:
    """The C++ compiler: ``$CXX``, else ``c++``, where it is on PATH (torch's builder reads the same)."""
    return shutil.which(os.environ.get("CXX", "c++"))


def cpp_extension_load(name: str, source: Path, flags: List[str], python_module: bool) -> Any:
    """``torch.utils.cpp_extension.load`` of one source: the module (``python_module``), else
    the path of the shared library it built and loaded."""
    from torch.utils import cpp_extension

    if compiler() is None:
        raise RuntimeError("no C++ compiler (c++ or $CXX) on PATH")
    # ninja (a dependency) installs its binary beside this interpreter, which a venv used
    # without activating has off PATH; torch's build looks for it on PATH.
    path = os.environ.get("PATH", "")
    scripts = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and scripts:
        os.environ["PATH"] = scripts + os.pathsep + path
    ldflags = ["-fopenmp"] if "-fopenmp" in flags else []
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))  # made if missing
    why = build_dir_unsafe(build_dir)
    if why:
        # Not this user's alone: what it holds is not loaded, and not built on either.
        private = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        log.warning("%s: %s; building into the private directory %s instead (make the extensions "
                    "directory, TORCH_EXTENSIONS_DIR, yours and not writable by others to keep one build)",
                    name, why, private)
        build_dir = private
        atexit.register(shutil.rmtree, private, ignore_errors=True)  # loaded libraries stay mapped
    try:
        with build_lock(build_dir):
            return cpp_extension.load(name, [str(source)], extra_cflags=flags, extra_ldflags=ldflags,
                                      build_directory=str(build_dir), is_python_module=python_module,
                                      verbose=False)
    finally:
        os.environ["PATH"] = path


class Build:
    """One source built once per process (and cached across processes), or None after one
    logged line saying why and what runs instead (``fallback``).

    ``load`` turns the built module or library path into what callers use, and raises where
    it is unfit (an ABI that does not match this module, a CPU the kernel was not written for);
    ``unfit``, asked before building, says why this machine cannot use it at all, or None.
    """

    def __init__(self, name: str, source: Path, flags: List[str], what: str, fallback: str,
                 load: Callable[[Any], Any], python_module: bool = False,
                 unfit: Optional[Callable[[], Optional[str]]] = None):
        self.name, self.source, self.flags = name, source, list(flags)
        self.what, self.fallback, self._load, self.python_module = what, fallback, load, python_module
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
                self._value = self._load(cpp_extension_load(self.name, self.source, self.flags, self.python_module))
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
