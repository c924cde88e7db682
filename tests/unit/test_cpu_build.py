"""trainer3d/cpu/build.py and build_dir.py: a build killed mid-way leaves nothing later builds
wait on, a live build is waited for a bounded time with a line naming the lock, and a cached
library someone else could have written is never loaded (a real library whose load would write
a marker file stands in for another user's code)."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer3d.cpu import build_dir, shm_barrier
from trainer3d.cpu.build import Build, build_directory, compiler

pytestmark = [pytest.mark.skipif(compiler() is None, reason="no C++ compiler"), pytest.mark.slow]

SOURCE = shm_barrier.LIBRARY.source


def _build_in_child(ext: str, name: str) -> subprocess.Popen:
    code = f"from trainer3d.cpu.build import Build; from pathlib import Path; " \
           f"print(Build({name!r}, Path({str(SOURCE)!r}), ['-O2'], 'test build', 'none', str).get())"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": ext}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


@pytest.mark.timeout(400)
def test_a_build_killed_mid_way_does_not_hold_up_the_next(tmp_path):
    """A builder is killed while torch's lock file exists (mid-build); the next build in a fresh
    process finishes (torch's builder alone waits on that file for ever)."""
    lock = tmp_path / "t3d_test_killed" / "lock"
    first = _build_in_child(str(tmp_path), "t3d_test_killed")
    deadline = time.monotonic() + 120
    while not lock.exists():
        assert first.poll() is None and time.monotonic() < deadline, "the first build never took its lock"
        time.sleep(0.005)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert lock.exists()  # what the killed build left
    second = _build_in_child(str(tmp_path), "t3d_test_killed")
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0 and out.strip().startswith(str(tmp_path)), out


def test_a_live_build_is_waited_for_a_bounded_time(tmp_path, monkeypatch, caplog):
    """Another process holds the build lock: the wait ends after WAIT_S with one line naming the
    lock file and the holder's pid, and the caller's fall-back runs."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    where = tmp_path / "t3d_test_busy"
    where.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from trainer3d.cpu.build_dir import held
        with held(Path({str(where)!r})):
            print('held', flush=True)
            time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(build_dir, "WAIT_S", 1.0)
        with caplog.at_level(logging.WARNING, logger="trainer3d.cpu.build"):
            assert Build("t3d_test_busy", SOURCE, ["-O2"], "test build", "the fall-back runs", str).get() is None
    finally:
        holder.kill()
        holder.wait()
    line = caplog.records[-1].getMessage()
    assert str(where / build_dir.LOCK_NAME) in line and f"pid {holder.pid}" in line and "the fall-back runs" in line


def _planted(tmp_path, name: str):
    """A library built in the extensions directory ``tmp_path``, then replaced by one whose load
    writes a marker file (another user's code), newer than its sources so no rebuild replaces it."""
    lib = Build(name, SOURCE, ["-O2"], "test build", "none", str).get()
    assert lib is not None and lib.startswith(str(tmp_path)), lib
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.c"
    evil.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                    f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    subprocess.run([compiler(), "-shared", "-fPIC", "-o", lib, str(evil)], check=True)
    later = time.time() + 5
    os.utime(lib, (later, later))
    return lib, marker


def _loose_file(lib, tmp_path):
    os.chmod(lib, 0o775)  # g+w


def _other_users_dir(lib, tmp_path):
    os.chown(os.path.dirname(lib), 4321, 4321)


def _other_users_root(lib, tmp_path):
    os.chown(tmp_path, 4321, 4321)


LOOSENED = [(_loose_file, "library-group-writable"), (_other_users_dir, "build-dir-other-uid"),
            (_other_users_root, "extensions-dir-other-uid")]


@pytest.mark.timeout(400)
def test_a_library_someone_else_could_write_is_not_loaded(tmp_path, monkeypatch):
    """Each way another user could have written the cached library (its file group-writable, its
    build directory or the extensions directory another uid's: giving a directory away needs
    root, so as another user the first case alone runs), each in an extensions directory of its
    own: one fresh process asks for each library in turn (a fresh process: the library this one
    loaded stays loaded under its name) and loads none of them, building a private one instead."""
    cases = [(loosen, case) for loosen, case in LOOSENED if loosen is _loose_file or os.geteuid() == 0]
    asked = []
    for loosen, case in cases:
        ext = tmp_path / case
        ext.mkdir()
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
        name = f"t3d_test_owner_{loosen.__name__.strip('_')}"
        lib, marker = _planted(ext, name)
        loosen(lib, ext)
        asked.append((case, str(ext), name, marker))
    code = textwrap.dedent(f"""
        import json, os, sys
        from pathlib import Path
        from trainer3d.cpu.build import Build
        for ext, name in json.loads(sys.argv[1]):
            os.environ["TORCH_EXTENSIONS_DIR"] = ext
            print(Build(name, Path({str(SOURCE)!r}), ['-O2'], 't', 'none', str).get(), flush=True)
        """)
    out = subprocess.run([sys.executable, "-c", code, json.dumps([[ext, name] for _, ext, name, _ in asked])],
                         capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, out.stderr
    built = out.stdout.split()
    assert len(built) == len(asked), out.stdout
    for (case, ext, name, marker), library in zip(asked, built):
        assert not marker.exists(), f"{case}: the planted library ran"
        assert library != "None" and not library.startswith(ext), (case, library)  # a private build instead
        said = [line for line in out.stderr.splitlines() if line.startswith(f"{name}: ") or f" {name}: " in line]
        assert any("building into the private directory" in line and ext in line for line in said), (case, out.stderr)


def _tool_that_logs(bin_dir, tool: str, real: str, log) -> str:
    path = bin_dir / tool
    path.write_text(f'#!/bin/sh\necho {tool} >> "{log}"\nexec "{real}" "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.timeout(400)
def test_a_finished_build_loads_in_a_fresh_process_without_the_compiler_and_a_changed_source_rebuilds(
        tmp_path, monkeypatch):
    """A fresh process loads what an earlier one built without starting the compiler or ninja
    (torch's ``load`` starts both in every fresh process) or importing torch's builder (which
    imports setuptools); a changed source, and a library another builder replaced, are built again."""
    started = tmp_path / "started"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ninja = shutil.which("ninja") or os.path.join(os.path.dirname(sys.executable), "ninja")
    monkeypatch.setenv("CXX", _tool_that_logs(bin_dir, "c++", compiler(), started))
    _tool_that_logs(bin_dir, "ninja", ninja, started)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "barrier.cpp"
    source.write_text(SOURCE.read_text())

    def build(fresh: bool) -> str:
        code = ("from trainer3d.cpu.build import Build; from pathlib import Path; "
                f"print(Build('t3d_test_stamp', Path({str(source)!r}), ['-O2'], 'test build', 'none', str).get()); "
                "import sys; print('torch.utils.cpp_extension' in sys.modules)")
        if not fresh:
            return Build("t3d_test_stamp", source, ["-O2"], "test build", "none", str).get()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        library, imported_builder = out.stdout.split()
        builder_imported.append(imported_builder == "True")
        return library

    builder_imported = []

    first = build(fresh=False)
    assert first.endswith(".so") and {"c++", "ninja"} <= set(started.read_text().split())
    started.unlink()
    assert build(fresh=True) == first and not started.exists(), "a finished build started the compiler or ninja again"
    assert builder_imported == [False], "a finished build imported torch's builder (and setuptools)"
    source.write_text(source.read_text() + "\n// changed\n")
    second = build(fresh=False)
    assert second.endswith(".so") and "c++" in started.read_text().split()  # built again
    started.unlink()
    os.utime(second)  # another builder's library in its place (one that keeps no stamp)
    assert build(fresh=True).endswith(".so") and "ninja" in started.read_text().split()


def test_the_build_directory_is_torchs(monkeypatch, tmp_path):
    """trainer3d/cpu/build.py finds torch's build directory without importing torch's builder;
    it is the one torch's builder names, with TORCH_EXTENSIONS_DIR and without."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # torch's call makes the directory
    for ext in (str(tmp_path / "ext"), None):
        if ext is None:
            monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCH_EXTENSIONS_DIR", ext)
        assert build_directory("t3d_dir") == Path(cpp_extension._get_build_directory("t3d_dir", verbose=False))
