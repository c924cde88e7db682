"""trainer3d/cpu/build.py and build_dir.py: a build killed mid-way leaves nothing later builds
wait on, a live build is waited for a bounded time with a line naming the lock, and a cached
library someone else could have written is never loaded (a real library whose load would write
a marker file stands in for another user's code)."""

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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loosen", [_loose_file, _other_users_dir, _other_users_root],
                         ids=["library-group-writable", "build-dir-other-uid", "extensions-dir-other-uid"])
def test_a_library_someone_else_could_write_is_not_loaded(tmp_path, monkeypatch, loosen):
    if loosen is not _loose_file and os.geteuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = f"t3d_test_owner_{loosen.__name__.strip('_')}"
    lib, marker = _planted(tmp_path, name)
    loosen(lib, tmp_path)
    # a fresh process: the library this one loaded stays loaded under its name
    out = subprocess.run([sys.executable, "-c", f"from trainer3d.cpu.build import Build; from pathlib import Path; "
                          f"print(Build({name!r}, Path({str(SOURCE)!r}), ['-O2'], 't', 'none', str).get())"],
                         env={**os.environ}, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr
    assert not marker.exists(), "the planted library ran"
    built = out.stdout.strip()
    assert built != "None" and not built.startswith(str(tmp_path)), built  # a private build instead
    assert "building into the private directory" in out.stderr and str(tmp_path) in out.stderr, out.stderr


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
