"""How many threads each Forage process gives torch, faiss, BLAS and tokenizers, and how their
idle OpenMP threads wait. One policy, applied by the `forage` command before any service
imports torch or faiss (services/cli.py), and by launchers for their children.

Why it matters (issues 15 and 16): torch and faiss each load their own libgomp (torch's
`torch/lib/libgomp.so.1`, faiss-cpu's bundled `libgomp-<hash>.so`), and libgomp's idle threads
spin by default (GOMP_SPINCOUNT, 300,000 pause loops, several milliseconds) before they sleep,
whenever a team is no larger than the CPUs. On a 2-core machine with one other busy process, a
team of 2 has one thread descheduled at almost every barrier while its partner spins, so every
small parallel region costs a scheduler slice: the retriever's single-query throughput fell
13x and SFT steps went from 0.55 s to 2-17 s. `OMP_WAIT_POLICY=PASSIVE` makes a waiting thread
sleep at once, so the core goes to whoever can use it; measured figures are in bench/README.md
(bench/retriever_load.py, bench/sft_load.py).

Knobs, all environment variables because libgomp reads them when the library loads (that is,
at `import torch` / `import faiss`, before any config file is read):

- `FORAGE_THREADS`: threads per process for torch intra-op, faiss and BLAS; `auto` (default)
  means usable cores ÷ `FORAGE_CPU_SHARE`, at least 1.
- `FORAGE_CPU_SHARE`: how many CPU-heavy processes share this machine's cores (default 1);
  `forage up` sets it for its children (the retriever when the run has one, learner, scorer and
  each rollout replica).
- The standard variables win when you set them yourself: `OMP_NUM_THREADS` (over
  `FORAGE_THREADS`), `OMP_WAIT_POLICY` (default here PASSIVE; ACTIVE or GOMP_SPINCOUNT to get
  libgomp's spinning back on a dedicated machine), `MKL_NUM_THREADS`, `OPENBLAS_NUM_THREADS`,
  `TOKENIZERS_PARALLELISM` (default here false).

Usable cores are the physical cores among the CPUs this process may run on (its affinity mask),
capped by a cgroup CPU quota (a container's `--cpus`, a Kubernetes CPU limit): torch itself
defaults to physical cores, and a quota of 2 CPUs on a 64-core node must not start 64 threads.
Threads are not pinned (no OMP_PROC_BIND): a pinned thread cannot move off a core that another
process is using, which is the case this policy is for.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

THREADS_VAR = "FORAGE_THREADS"
SHARE_VAR = "FORAGE_CPU_SHARE"
# The names the policy filled in (not set by the user), comma-separated: a launcher drops them
# from its children's environment so each child recomputes them for its own share.
FILLED_VAR = "FORAGE_THREADS_FILLED"

# Every variable that sets a thread count, for the libraries Forage loads: torch and faiss
# (libgomp: OMP_NUM_THREADS), MKL inside torch, OpenBLAS inside numpy (its own pthreads pool).
COUNT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
DEFAULT_WAIT_POLICY = "PASSIVE"
# Every environment variable that sets a thread count or how idle threads wait, this policy's
# own included: a benchmark that runs a command "as shipped" removes them all from its caller's
# environment so that the command's policy decides (bench/efficacy.py, sft_load.py, ...).
THREAD_SETTINGS = (*COUNT_VARS, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TOKENIZERS_PARALLELISM",
                   "RAYON_NUM_THREADS", THREADS_VAR, SHARE_VAR, FILLED_VAR)


def without_thread_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of `environ` with none of THREAD_SETTINGS."""
    return {k: v for k, v in environ.items() if k not in THREAD_SETTINGS}


class ThreadSettingError(ValueError):
    """A thread variable that is not a positive integer (the message names it)."""


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    reason: str  # where the count came from, for the log line
    env: dict[str, str] = field(default_factory=dict)  # what to set (names the user left unset)

    def describe(self) -> str:
        return f"{self.threads} thread(s) per library ({self.reason})"


def _positive_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ThreadSettingError(f"{name}={raw!r}: must be a positive integer")
    return value


def plan_threads(environ: Mapping[str, str], cores: int) -> ThreadPlan:
    """The thread count and the variables to set, from the environment and the usable cores.

    Pure: reads only its arguments. OMP_NUM_THREADS (the user's) wins, then FORAGE_THREADS,
    else cores ÷ FORAGE_CPU_SHARE. `env` holds the variables the user did not set; the ones a
    parent's policy filled in (listed in FORAGE_THREADS_FILLED) count as unset and are
    recomputed, so a child does not mistake them for a user's choice.
    """
    filled = {name for name in environ.get(FILLED_VAR, "").split(",") if name}
    environ = {name: value for name, value in environ.items() if name not in filled}
    share = _positive_int(environ, SHARE_VAR) or 1
    omp = _positive_int(environ, "OMP_NUM_THREADS")
    forced = None if environ.get(THREADS_VAR, "").strip().lower() in ("", "auto") else (
        _positive_int(environ, THREADS_VAR))
    if omp is not None:
        threads, reason = omp, "OMP_NUM_THREADS"
    elif forced is not None:
        threads, reason = forced, THREADS_VAR
    else:
        threads = max(1, cores // share)
        reason = f"auto: {cores} core(s) / {share} process(es)"
    wanted = {name: str(threads) for name in COUNT_VARS}
    wanted["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
    wanted["TOKENIZERS_PARALLELISM"] = "false"
    env = {name: value for name, value in wanted.items() if not environ.get(name, "").strip()}
    return ThreadPlan(threads, reason, env)


def child_environ(environ: Mapping[str, str], share: int) -> dict[str, str]:
    """The environment for a launcher's children that share the cores `share` ways: the values
    this policy filled in are dropped (each child recomputes them for its share); what the user
    set is kept, so OMP_NUM_THREADS=8 still means 8 everywhere."""
    filled = {name for name in environ.get(FILLED_VAR, "").split(",") if name}
    env = {name: value for name, value in environ.items() if name not in filled}
    env.pop(FILLED_VAR, None)
    env[SHARE_VAR] = str(max(1, share))
    return env


def parse_cgroup_quota(cpu_max: str | None, quota_us: str | None = None,
                       period_us: str | None = None) -> int | None:
    """CPUs allowed by a cgroup quota, rounded up: v2's `cpu.max` ("max 100000" or
    "200000 100000"), else v1's cfs_quota_us / cfs_period_us (-1 = none). None: no quota."""
    try:
        if cpu_max is not None:
            quota, _, period = cpu_max.strip().partition(" ")
            if quota == "max":
                return None
            return max(1, math.ceil(int(quota) / int(period or "100000")))
        if quota_us is not None and period_us is not None:
            quota_v1 = int(quota_us)
            if quota_v1 <= 0:
                return None
            return max(1, math.ceil(quota_v1 / int(period_us)))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def usable_cores() -> int:
    """Physical cores this process may use: its affinity mask, scaled by the machine's
    physical/logical ratio (SMT siblings), capped by a cgroup CPU quota."""
    try:
        logical = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        logical = os.cpu_count() or 1
    total_logical = os.cpu_count() or logical
    physical = None
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001 (no psutil or no topology: count logical CPUs)
        physical = None
    cores = logical
    if physical and total_logical > physical:
        cores = max(1, logical * physical // total_logical)
    quota = parse_cgroup_quota(_read("/sys/fs/cgroup/cpu.max"),
                               _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                               _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
    return min(cores, quota) if quota else cores


def set_library_threads(threads: int) -> None:
    """Set the count in torch and faiss if they are already imported (a process that imported
    them before the policy ran: tests, benchmarks, notebooks). Their wait policy can no longer
    change then: libgomp read OMP_WAIT_POLICY when it loaded."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    faiss = sys.modules.get("faiss")
    if faiss is not None:
        faiss.omp_set_num_threads(threads)


def apply_thread_policy(environ: MutableMapping[str, str] | None = None,
                        cores: int | None = None) -> ThreadPlan:
    """Fill in the thread variables the user left unset, before torch/faiss are imported, so
    libgomp reads them at load; child processes inherit them. Idempotent. A torch or faiss that
    is already loaded is left alone (its host chose; see set_library_threads). Raises
    ThreadSettingError for a malformed variable."""
    target = os.environ if environ is None else environ
    plan = plan_threads(target, usable_cores() if cores is None else cores)
    filled = {name for name in target.get(FILLED_VAR, "").split(",") if name}
    for name, value in plan.env.items():
        target[name] = value
    filled |= set(plan.env)
    if filled:
        target[FILLED_VAR] = ",".join(sorted(filled))
    return plan


# A server's independent batches (the retriever's micro-batches) run on several workers of a
# few threads each rather than one worker with every thread: a one-thread worker never waits at
# an OpenMP barrier for a descheduled partner. Past 8 workers the Python glue of each batch
# (tokenising, documents, JSON) under the GIL would start to serialise them, so a big node
# gets 8 workers with several threads each. A GPU runs one batch at a time: one worker.
MAX_AUTO_WORKERS = 8


def split_workers(threads: int, workers: int = 0, device: str = "cpu") -> tuple[int, int]:
    """(workers, threads per worker) for `threads` threads; `workers` 0 means choose."""
    if workers <= 0:
        workers = 1 if device.startswith("cuda") else min(max(1, threads), MAX_AUTO_WORKERS)
    return workers, max(1, threads // workers)


def process_threads() -> int:
    """This process's thread count under the policy (what apply_thread_policy chose)."""
    return plan_threads(os.environ, usable_cores()).threads


def set_worker_threads(threads: int) -> dict[str, int]:
    """Run on a worker thread: its OpenMP thread count (libgomp keeps one per thread, so
    `faiss.omp_set_num_threads` on the main thread does not reach a worker) in torch and faiss
    where loaded; returns what they report back on this thread."""
    set_library_threads(threads)
    return _library_threads()


def _library_threads() -> dict[str, int]:
    """torch's and faiss's thread counts on the calling thread, for those already loaded."""
    report: dict[str, int] = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        report["torch"] = torch.get_num_threads()
    faiss = sys.modules.get("faiss")
    if faiss is not None:
        report["faiss"] = faiss.omp_get_max_threads()
    return report


def thread_report() -> dict[str, object]:
    """What this process runs with now (for /healthz and logs): torch's and faiss's thread
    counts where loaded, and the wait policy libgomp read."""
    return {"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), **_library_threads()}
