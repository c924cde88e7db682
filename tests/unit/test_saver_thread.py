"""A background save's report comes back only once its thread is gone, staged copy freed
(trainer3d/checkpoint/saver.py, ``Background._finish``). A thread still freeing the copy when
the interpreter finalizes is ended by ``pthread_exit`` inside torch's C++ tensor free, which
calls ``std::terminate``: a complete ``launcher=inplace`` run under torchrun aborted at exit
(SIGABRT) about one time in three (CPython gh-87135; the gdb backtrace showed the save
thread in ``THPVariable_clear`` -> ``take_gil`` -> ``PyThread_exit_thread``)."""

import threading
import time

import torch

from trainer3d.checkpoint.saver import Background, SaveGroups, SaveJob, SaveReport

FREED = []


class SlowToFree:
    """A staged entry whose release takes a while, as a large tensor's does; it says when done."""

    def __del__(self):
        time.sleep(0.5)
        FREED.append(True)


def test_the_report_comes_after_the_save_thread_freed_its_copy(tmp_path):
    FREED.clear()
    background = Background(SaveGroups(None, None), 0, lambda text: None, torch.device("cpu"))
    job = SaveJob(3, {"w": torch.arange(12.0), "slow": SlowToFree()}, tmp_path, {"step": 3}, keep=2, known_bad=[])
    report = SaveReport(3, job.final, stall_s=0.0)
    background.start(job, report)
    del job  # the manager keeps no reference: the save's thread holds the last one
    assert background.wait("the test", timeout_s=120) is report
    assert FREED == [True]
    assert not [t for t in threading.enumerate() if t.name.startswith("trainer3d-checkpoint")]
