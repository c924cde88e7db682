// The barrier of the shared-memory collectives (trainer3d/cpu/shm_barrier.py builds and loads this
// file; trainer3d/cpu/shm.py uses it between the phases of a collective).
//
// The ranks of one host share a 32-bit count in their segment. Every arrival adds one; a
// rank's k-th barrier is passed once the count reaches k * world, so the count never needs
// resetting (compared modulo 2^32). A rank that arrives before the others spins for a few
// microseconds, then sleeps in the kernel on the count (futex(2), FUTEX_WAIT on a shared
// mapping), and the last arrival wakes the sleepers (FUTEX_WAKE). Sleeping, not spinning or
// yielding, is what keeps an oversubscribed host (more ranks than cores) at full pace: a
// waiting rank takes no CPU from the ranks still computing.
//
// Liveness: each rank holds a POSIX record lock on one byte of the segment's file (its rank's
// offset) for as long as it lives; the kernel drops a process's record locks when it exits, a
// crash included, and a fork's child does not inherit them. The Python side looks at its peers'
// locks whenever a wait here returns without the barrier passed (every slice_us), so a dead
// peer ends the collective within a slice rather than the group's timeout.

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>

namespace {

inline bool reached(uint32_t count, uint32_t target) { return static_cast<int32_t>(count - target) >= 0; }

inline int64_t now_us() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000 + t.tv_nsec / 1000;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

extern "C" {

int t3d_shm_barrier_abi() { return 1; }

// Add this rank's arrival; the arrival that brings the count to ``target`` wakes the sleepers.
// The add is a release (and acquire) operation: this rank's writes to the segment before it
// are visible to every rank that sees the barrier passed.
void t3d_barrier_arrive(uint32_t* count, uint32_t target) {
  if (__atomic_add_fetch(count, 1, __ATOMIC_ACQ_REL) == target) {
    syscall(SYS_futex, count, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

// Wait until the count reaches ``target``: spin up to ``spin_us`` microseconds, then sleep in
// the kernel. Returns 0 once passed, 1 when ``slice_us`` went by without that (the caller looks
// at its peers and its deadline, then waits again).
int t3d_barrier_wait(uint32_t* count, uint32_t target, int64_t spin_us, int64_t slice_us) {
  const int64_t start = now_us();
  for (int i = 0;; ++i) {
    if (reached(__atomic_load_n(count, __ATOMIC_ACQUIRE), target)) return 0;
    if ((i & 63) == 0 && now_us() - start >= spin_us) break;
    cpu_relax();
  }
  for (;;) {
    const uint32_t seen = __atomic_load_n(count, __ATOMIC_ACQUIRE);
    if (reached(seen, target)) return 0;
    const int64_t left = slice_us - (now_us() - start);
    if (left <= 0) return 1;
    timespec rel{static_cast<time_t>(left / 1000000), static_cast<long>(left % 1000000) * 1000};
    // Sleeps only while the count still equals ``seen``; wakes on FUTEX_WAKE, a signal or the
    // timeout, any of which is followed by another look (EAGAIN: it changed meanwhile).
    syscall(SYS_futex, count, FUTEX_WAIT, seen, &rel, nullptr, 0);
  }
}

// Take (``take`` != 0) this rank's lock on byte ``at`` of ``fd``'s file, or look whether another
// process holds the lock on it. Returns 0: taken, or free; 1: held by another process; -errno.
int t3d_byte_lock(int fd, int64_t at, int take) {
  struct flock lk {};
  lk.l_type = F_WRLCK;
  lk.l_whence = SEEK_SET;
  lk.l_start = at;
  lk.l_len = 1;
  if (take) return fcntl(fd, F_SETLK, &lk) == 0 ? 0 : -errno;
  if (fcntl(fd, F_GETLK, &lk) != 0) return -errno;
  return lk.l_type == F_UNLCK ? 0 : 1;
}

}  // extern "C"
