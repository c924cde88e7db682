"""Follow a job from the submitting process: echo rank 0's progress; on a failure, end the
job at once and say which rank caused it.

A failure is seen three ways: a rank's error result (submitit's result pickle); a rank whose
process is gone without a result (its heartbeat, trainer3d/rank/heartbeat.py, names its pid,
and on this host /proc shows it gone: killed, out of memory, crashed outside Python); or a
rank whose heartbeat stopped for longer than ``parallel.timeout_s`` while the job runs: beside
ranks that still beat, or alone (a one-rank job, or every rank frozen, is ended too: no peer is
needed to see it). Then the follower takes its diagnosis and ends the job once every rank is
accounted for — a result, an exit, a stale beat, a process seen gone, or a beat seen after the
trouble began (a rank alive since: waiting longer cannot make it the cause) — or after
``SETTLE_S``: the one case that waits is a rank whose last beat came before the trouble and is
not yet stale (it may be the stopped rank, or a lost node's, behind the others' errors; a beat
seen just before the trouble is no sign of life after it), or a rank that never beat. It does not wait for the victims to time out a second time. So a rank
stopped with SIGSTOP ends the job about one ``parallel.timeout_s`` after it stopped, a killed
local rank ends it at once, and the report names them rather than the ranks that timed out
waiting for them.

The report leads with one line, the likeliest cause, in this order: ranks whose heartbeat
stopped (a whole node's ranks: that node), else ranks seen dead without a result, else the
earliest error (by the time its result was written), else ranks that exited without a result.
"""

import pickle
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import submitit

from trainer3d.rank.heartbeat import STALE_S, Beat, HeartbeatReader

POLL_S = 0.5
SETTLE_S = STALE_S + 2.0
_OWN_PREFIX = "trainer3d.observe.failure.RankFailed: "
_DIED = "exited without a result (killed, out of memory, or crashed outside Python)"


class _Tail:
    """Echo the new complete lines of a growing log file (rank 0's stdout). A requeued Slurm
    job's next attempt truncates it (sbatch's default --open-mode): start again from its top."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def echo(self) -> None:
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self.pos:
                    self.pos = 0
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.pos += end
        for line in data[:end].decode(errors="replace").splitlines():
            if not line.startswith("submitit "):
                print(line, flush=True)


def _task_outcome(job: submitit.Job, task: int) -> Optional[tuple]:
    """("success", result) or ("error", traceback text) once task's result is written, else None."""
    path = job.task(task).paths.result_pickle
    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (EOFError, pickle.UnpicklingError):  # being written
        return None


def _proc_state(beat: Beat) -> Optional[str]:
    """The state letter /proc gives the rank's process (R, S, T, Z...), "gone" when it has no
    entry, None when it runs on another host (nothing to look at from here)."""
    if beat.host != socket.gethostname():
        return None
    try:
        return Path(f"/proc/{beat.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _dead(beat: Beat) -> bool:
    """The rank's process ended on this host: no /proc entry, or a zombie not yet reaped. (A pid
    reused by another process reads as alive: the rank is then judged by its beat alone.)"""
    return beat.state == "running" and _proc_state(beat) in ("gone", "Z")


def _process_state(beat: Beat) -> str:
    """What became of a stale rank's process, where we can look (same host)."""
    state = _proc_state(beat)
    if state is None:
        return f"pid {beat.pid} on {beat.host}"
    what = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "Z": "gone", "D": "stuck in the kernel (I/O)",
            "gone": "gone"}
    return f"pid {beat.pid} on {beat.host}: {what.get(state, 'alive but frozen')}"


@dataclass
class Watch:
    """What the follower knows while the job runs: outcomes, heartbeats, and when trouble began."""

    num_tasks: int
    timeout_s: float
    reader: Optional[HeartbeatReader] = None
    running: Callable[[], bool] = lambda: True
    """Whether the job's ranks are running now (Slurm: the job's state; a pending requeue is not)."""
    stale_s: float = STALE_S
    pids_here: bool = False
    """Whether a record's pid is a process this one can look up in /proc (a local job: same host,
    same pid namespace); a Slurm node's pid is read only as words in the report."""
    outcomes: Dict[int, Optional[tuple]] = field(default_factory=dict)
    beats: Dict[int, Beat] = field(default_factory=dict)
    stale: Dict[int, Beat] = field(default_factory=dict)
    """Ranks seen without a beat for ``stale_s`` while the job was still running."""
    dead: Dict[int, Beat] = field(default_factory=dict)
    """Ranks whose record says running, without a result, whose process is gone (``pids_here``)."""
    trouble_at: Optional[float] = None
    running_since: Optional[float] = field(default_factory=time.monotonic)
    """This process's clock when the job was last seen start running (None: queued); from the
    watch's start at the latest."""

    def update(self, job: submitit.Job) -> None:
        self.outcomes = {t: _task_outcome(job, t) for t in range(self.num_tasks)}
        self.judge()

    def judge(self) -> None:
        """Read the beats; trouble is a rank's error, a rank seen dead, or a rank silent for over
        ``timeout_s``.

        With a peer still beating, the silent rank is the cause. With none (one rank, or every
        rank frozen), silence is held against the ranks only while the job runs, and counted
        from when it started running at the earliest: a requeued job's last attempt leaves its
        records "running" while it waits in the queue, and its next attempt's ranks need a
        moment before they beat. No peer is needed to see a rank stop."""
        self.beats = self.reader.read() if self.reader else {}
        now = time.monotonic()
        self.stale = {r: b for r, b in self.beats.items()
                      if b.state == "running" and b.age(now) >= self.stale_s and self.outcomes.get(r) is None}
        self.dead = self._seen_dead() if self.pids_here else {}
        fresh = [b for b in self.beats.values() if b.state == "running" and b.age(now) < self.stale_s]
        if fresh:
            silent_s = max((b.age(now) for b in self.stale.values()), default=0.0)
        elif self.stale and self.running():
            self.running_since = now if self.running_since is None else self.running_since
            silent_s = min(max(b.age(now) for b in self.stale.values()), now - self.running_since)
        else:
            silent_s = 0.0
            if self.stale:  # queued again (a requeue): its next start is counted from then
                self.running_since = None
        errored = any(o and o[0] == "error" for o in self.outcomes.values())
        if self.trouble_at is None and (errored or self.dead or silent_s > self.timeout_s):
            self.trouble_at = now

    def _seen_dead(self) -> Dict[int, Beat]:
        """Ranks whose process is gone while their record says running. A rank that returns or
        raises marks its record "exited" before its process ends (TrainTask's finally), so the
        records are read again after /proc: one that ended cleanly in between is not taken for dead."""
        gone = [r for r, b in self.beats.items() if self.outcomes.get(r) is None and _dead(b)]
        if not gone:
            return {}
        self.beats = self.reader.read()
        return {r: self.beats[r] for r in gone if r in self.beats and self.beats[r].state == "running"}

    def settled(self) -> bool:
        """Trouble seen, and every rank accounted for (module docstring), or SETTLE_S passed."""
        if self.trouble_at is None:
            return False
        if time.monotonic() - self.trouble_at >= SETTLE_S:
            return True
        return all(self._known(t) for t in range(self.num_tasks))

    def _known(self, rank: int) -> bool:
        """Whether waiting can tell more about ``rank``: not once it has a result, has exited,
        went stale, is seen dead, or beat after the trouble began (alive since: no stopped rank's
        silence). A beat seen before it proves nothing: a rank killed with its node a moment
        before a peer's connection was reset beat a moment before too."""
        beat = self.beats.get(rank)
        return (self.outcomes.get(rank) is not None or rank in self.stale or rank in self.dead
                or (beat is not None and (beat.state == "exited" or beat.seen_change > self.trouble_at)))


def follow(job: submitit.Job, timeout_s: float, heartbeats: Optional[Path] = None,
           end: Optional[Callable[[], None]] = None, running: Optional[Callable[[], bool]] = None,
           job_token: Optional[str] = None, slurm_job: Optional[str] = None, pids_here: bool = False) -> int:
    """Echo rank 0's progress until every task ends; on a failure, end the job and explain.

    ``heartbeats``: the job's heartbeat directory, if its ranks write one. ``end``: how to end
    the job (default: submitit's cancel). ``running``: whether the job's ranks run now (not
    queued), asked only while no rank beats; None: always (local processes). ``job_token``: the
    job's ``TRAINER3D_JOB`` mark, ``slurm_job`` its Slurm job id: a killed earlier job's heartbeats
    (a lost node's, in the same run dir) are not read as this one's. ``pids_here``: the ranks run
    on this machine in this pid namespace (a local job), so a rank whose process is gone is seen
    dead at once rather than when its beat goes stale."""
    tail = _Tail(job.task(0).paths.stdout)
    reader = HeartbeatReader(heartbeats, job.num_tasks, job_token, slurm_job) if heartbeats else None
    watch = Watch(job.num_tasks, timeout_s, reader, running or (lambda: True), pids_here=pids_here)
    cancelled, silent = False, None
    while not job.done():
        tail.echo()
        watch.update(job)
        if watch.settled():
            silent = stale_lines(watch.stale, watch.beats)  # before ending: what the processes are doing now
            (end or job.cancel)()
            cancelled = True
            _wait_done(job, timeout_s=30)
            break
        time.sleep(POLL_S)
    tail.echo()
    return report(job, watch, cancelled, silent)


def _wait_done(job: submitit.Job, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not job.done() and time.time() < deadline:
        time.sleep(POLL_S)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    line = lines[-1][:300] if lines else ""
    return line[len(_OWN_PREFIX):] if line.startswith(_OWN_PREFIX) else line


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def stale_lines(stale: Dict[int, Beat], beats: Dict[int, Beat]) -> List[str]:
    """One line per node whose every rank went silent (when others still beat), else per rank;
    the first to go silent first, the likeliest cause: a lost node's survivors beat on, blocked
    in its collectives, until a timeout or Slurm's abort of the step (srun's "io error ... on
    node 1") kills them too, seconds later."""
    hosts = {b.host for b in beats.values()}
    lines, named = [], set()
    for host in sorted({b.host for b in stale.values()}):
        on_host = sorted(r for r, b in beats.items() if b.host == host)
        if len(hosts) > 1 and all(r in stale for r in on_host):
            steps = sorted({stale[r].step for r in on_host})
            silent_since = max(stale[r].seen_change for r in on_host)  # when the node's last rank went quiet
            lines.append((silent_since, f"node {host} stopped responding: ranks {', '.join(map(str, on_host))} "
                                        f"sent no heartbeat after step {steps[0]} (node lost, or its processes "
                                        f"killed or stopped)"))
            named.update(on_host)
    now = time.monotonic()
    for r in sorted(set(stale) - named):
        b = stale[r]
        lines.append((b.seen_change, f"rank {r} stopped making progress after step {b.step}: no heartbeat for "
                                     f"{b.age(now):.0f} s ({_process_state(b)})"))
    return [line for _, line in sorted(lines, key=lambda entry: entry[0])]


def report(job: submitit.Job, watch: Watch, cancelled: bool = False, silent: Optional[List[str]] = None) -> int:
    """0 if every rank returned; else print the likeliest cause in one line, then each rank's fate."""
    tasks = range(watch.num_tasks)
    outcomes = {t: _task_outcome(job, t) for t in tasks}
    errors = {t: o[1] for t, o in outcomes.items() if o and o[0] == "error"}
    missing = [t for t, o in outcomes.items() if o is None and t not in watch.stale]
    dead = [t for t in missing if t in watch.dead]
    if not errors and not missing and not watch.stale:
        return 0
    by_time = sorted(errors, key=lambda t: job.task(t).paths.result_pickle.stat().st_mtime)
    silent = stale_lines(watch.stale, watch.beats) if silent is None else silent
    fates = {t: (f"still running at step {watch.beats[t].step} after the others failed; cancelled"
                 if t in watch.beats else "still running after the others failed; cancelled")
             if cancelled and t not in dead else _DIED
             for t in missing}
    if silent:
        cause = silent[0]
    elif dead:
        cause = f"rank {dead[0]}: {fates[dead[0]]}"
    elif missing and (not cancelled or not by_time):  # a rank that died without a word comes first
        cause = f"rank {missing[0]}: {fates[missing[0]]}"
    else:
        cause = f"rank {by_time[0]}: {_last_line(errors[by_time[0]])}"
    print(f"\ntrainer3d: job {job.job_id} failed: {cause}", file=sys.stderr)
    for line in silent[1:]:
        print(f"  {line}", file=sys.stderr)
    for t in missing:
        print(f"  rank {t}: {fates[t]}", file=sys.stderr)
    for t in by_time:
        print(f"  rank {t}: {_last_line(errors[t])}", file=sys.stderr)
    if dead or (missing and not cancelled):
        t = (dead or missing)[0]
        print(f"--- rank {t} log tail ({job.task(t).paths.stderr}) ---\n{_log_tail(job.task(t).paths.stderr)}",
              file=sys.stderr)
    elif by_time:
        print(f"--- rank {by_time[0]} traceback ---\n{errors[by_time[0]]}", file=sys.stderr)
    return 1
