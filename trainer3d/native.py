"""Small plain C++ sources of the package (no torch headers), built on first use with the
machine's compiler into shared libraries and loaded with ``ctypes``.

Users: model/cpu_kernels.py (RMSNorm, RoPE, SwiGLU) and parallel/host_barrier.py (the
shared-memory collectives' barrier). A build takes a second or so; it is cached under torch's
extension directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) in a file
named by the hash of the source, the flags and the compiler's version, written to a temporary
name and renamed, so ranks that build at once do not collide and a changed source never loads
a stale build. Where there is no compiler or the build fails, ``NativeLibrary.get`` logs one
line and returns None; its callers then run their torch (or gloo) fall-back.
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 300


def compiler() -> Optional[str]:
    """The C++ compiler: ``$CXX``, else ``c++``, where it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


class NativeLibrary:
    """One source file built with ``flags``; ``signatures`` maps each exported function to
    (argument types, result type). The source exports ``int <stem>_abi()``, checked against
    ``abi`` on load so that a module and a build from different versions never pair up."""

    def __init__(self, source: Path, flags: List[str], abi: int, signatures: Dict[str, tuple], what: str,
                 fallback: str):
        self.source, self.flags, self.abi, self.signatures = source, list(flags), abi, signatures
        self.what, self.fallback = what, fallback
        self._lib: Optional[ctypes.CDLL] = None
        self._tried = False

    def path(self, cxx: str) -> Path:
        """Where the build for this source, these flags and this compiler lives."""
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
        digest = hashlib.sha256(self.source.read_bytes() + " ".join(self.flags).encode()
                                + version.encode()).hexdigest()[:16]
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
        stem = self.source.stem
        return root / f"trainer3d_{stem}" / f"{stem}_{digest}.so"

    def _build(self, cxx: str) -> Path:
        target = self.path(cxx)
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cxx, *self.flags, str(self.source), "-o", tmp], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1])
            os.replace(tmp, target)  # atomic: a rank building at the same moment replaces it with equal bytes
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target

    def _load(self) -> ctypes.CDLL:
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler (c++ or $CXX) on PATH")
        lib = ctypes.CDLL(str(self._build(cxx)))
        abi = getattr(lib, f"{self.source.stem}_abi")()
        if abi != self.abi:
            raise RuntimeError(f"the built library speaks ABI {abi}, this module {self.abi}")
        for name, (args, result) in self.signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
        return lib

    def get(self) -> Optional[ctypes.CDLL]:
        """The loaded library, built once per machine; None where it cannot be, after one
        logged line saying why."""
        if not self._tried:
            self._tried = True
            try:
                self._lib = self._load()
            except Exception as e:  # any build or load failure leaves the caller's fall-back in place
                log.warning("%s: %s; %s", self.what, f"{type(e).__name__}: {e}", self.fallback)
                self._lib = None
        return self._lib
