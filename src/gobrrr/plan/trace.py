"""Tracing a workload at a chosen micro-batch, for the planner."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import select
import signal
import struct
import sys
import tempfile
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gobrrr.capture import capture
from gobrrr.capture.deepen import capture_deep
from gobrrr.capture.sdpa import target_for
from gobrrr.errors import GobrrrError
from gobrrr.estimate import workload_factory
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Target
from gobrrr.models.registry import describe, get_workload, model_names
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.probe import samples
from gobrrr.training.cudagraph import make_capturable
from gobrrr.training.fp8 import traced_fp8
from gobrrr.training.fused_loss import use_fused_loss
from gobrrr.training.offload import stand_in
from gobrrr.training.optim_trace import traced_states_optimizer
from gobrrr.workload import Workload, map_tensors


class Tracer:
    """micro-batch -> the step graph of the workload at that micro-batch.

    The workload is built at each micro-batch: one that takes `batch_size` (a built-in, or a
    function with that argument) then has that many samples and is traced as built. One whose
    batch stays its own (a Workload, or a function without it) has its first samples cut:
    every micro-batch must then be at most its batch.
    """

    def __init__(
        self,
        source: Any,
        *,
        seq: int | None,
        precision: str,
        target: Target,
        variant: Knobs | None = None,
        ahead: Ahead | None = None,
    ) -> None:
        self.source, self.seq, self.precision, self.target = source, seq, precision, target
        self.variant = variant or Knobs(micro_batch=1)
        self.traces = 0
        self.ahead = ahead

    def __call__(self, micro_batch: int) -> StepGraph:
        """The step graph at `micro_batch`: traced here, or by the process `ahead` started
        for it (`expect`)."""
        self.traces += 1
        if self.ahead is not None:
            return self.ahead.get(self, micro_batch)
        return self.trace(micro_batch)

    def expect(self, micro_batches: Iterable[int]) -> None:
        """Say which micro-batches will be asked for, in the order they will be: with an
        `ahead` pool they are traced in other processes meanwhile."""
        if self.ahead is not None:
            self.ahead.expect(self, micro_batches)

    def trace(self, micro_batch: int) -> StepGraph:
        """Trace the step at `micro_batch` in this process: a built-in transformer's from
        traces with a few of its blocks (`capture.deepen`), the same graph in less time."""
        kwargs = dict(
            precision=self.variant.precision(self.precision),
            sdpa=target_for(self.target.gpu.full_name),
            compile=self.variant.compile,
        )
        depth = self._depth()
        if depth is not None:
            return capture_deep(lambda d: self._variant(self._at(micro_batch, d)), depth, **kwargs)
        return capture(self._variant(self._maker(micro_batch)), **kwargs)

    def _depth(self) -> int | None:
        """The blocks of a built-in transformer traced in a variant that `capture.deepen` is
        held to (tests/test_deepen.py): eager, the optimizer and weights as built, the fused
        loss or not; None otherwise."""
        v = self.variant
        if not isinstance(self.source, str) or self.source not in model_names():
            return None
        if v.compiled or v.fp8 or v.offload or v.cuda_graph:
            return None
        if v.optimizer_states != "as-is" or v.weights != "as-is":
            return None
        info = describe(self.source)
        return info.get("layers") if info["family"] in ("gpt2", "llama") else None

    def _at(self, m: int, blocks: int):
        """The built-in workload at micro-batch m with `blocks` blocks."""
        return lambda: get_workload(self.source, batch_size=m, seq_len=self.seq, n_layer=blocks)

    def _maker(self, m: int):
        """The workload at micro-batch m: built at m, and its first m samples cut where its
        batch stayed its own."""
        build = workload_factory(self.source, m, self.seq)

        def make() -> Workload:
            w = build()
            return w if samples(w) == m else _cut(w, m)

        return make

    def _variant(self, make):
        """The workload as `gobrrr.apply` will run it: the fused loss in place of the head
        and loss, the optimizer keeping its states as planned (8-bit: torchao's states and
        one traced op per update, `optim_trace`), or offloaded (torchao's CPUOffloadOptimizer,
        traced as gobrrr.training.offload's stand-in); the linears converted to torchao's
        Float8Linear for FP8 training (traced as they run: `fp8.traced_fp8`); for a step
        captured as a CUDA graph, the optimizer made capturable, as apply makes it."""
        v = self.variant
        plain = v.optimizer_states == "as-is" and not v.offload and not v.cuda_graph
        if not v.fused_loss and plain and not v.fp8:
            return make
        if v.offload and v.optimizer_states != "as-is":
            raise GobrrrError(
                f"offload with optimizer_states={v.optimizer_states!r} is not "
                "planned: offload keeps the optimizer's own states (as-is)"
            )

        def build() -> Workload:
            w = make()
            if v.fused_loss:
                use_fused_loss(w.model)
            if v.fp8:
                traced_fp8(w.model)
            user = w.optimizer or (lambda ps: torch.optim.AdamW(ps, lr=3e-4))
            if v.offload:
                w.optimizer = lambda ps: stand_in(user(ps))
            elif v.optimizer_states != "as-is":
                w.optimizer = lambda ps: traced_states_optimizer(user(ps), v.optimizer_states)
            if v.cuda_graph:  # as apply captures it: step counts on the device
                w.optimizer = lambda ps, made=w.optimizer or user: make_capturable(made(ps))
            return w

        return build


class Ahead:
    """Traces run ahead in worker processes, `processes` of them: a trace is seconds of
    single-threaded Python over fake tensors, each independent of the others, so on a machine
    with cores to spare the planner's traces overlap one another and its costing.

    The workers are forked when the planner starts, before its first backward: autograd
    refuses to run in a child forked after its parent ran one (its worker threads do not
    survive a fork). Each worker traces the jobs it is given one after another, as this
    process would (the same code; from its second trace on, with the fake-tensor caches and
    lazily built tables of a process that has traced, as this one's later traces are), and
    hands each StepGraph back pickled, with the warnings it raised (raised here again). A
    trace that fails in a worker is traced again here, which raises its error where the
    search meets it.

    Not for a model whose code calls TorchScript functions (`uses_torchscript`): a process's
    first run of those differs from its later ones (see `passes.microbatch.family`), and the
    trace a worker makes first need not be this process's first. The workload function runs
    in the worker: side effects it has (a counter, a print) happen there, so the Python API
    leaves this off (`Planner(ahead=0)`) and the command line, whose process is gobrrr's own,
    turns it on.
    """

    def __init__(self, processes: int) -> None:
        stall_limit_s()  # a bad GOBRRR_TRACE_TIMEOUT is refused before any work
        self.queue: list[tuple[Tracer, int]] = []
        self.jobs: dict[tuple[int, int], _Job] = {}  # (id(tracer), m) -> its job, once sent
        self.received = 0  # traces a worker made
        self.here = 0  # traces made in this process (its autograd threads then exist)
        self._tracers: dict[int, Tracer] = {}  # kept alive while their ids key jobs
        self._next = 0
        self.workers = [w for w in (_Worker.start() for _ in range(processes)) if w]
        self.processes = len(self.workers)
        self._finalizer = weakref.finalize(self, _shut, self.workers, self.jobs)

    def expect(self, tracer: Tracer, micro_batches: Iterable[int]) -> None:
        for m in micro_batches:
            if (id(tracer), m) not in self.jobs and (tracer, m) not in self.queue:
                self._tracers[id(tracer)] = tracer
                self.queue.append((tracer, m))
        self._fill()

    def get(self, tracer: Tracer, m: int) -> StepGraph:
        """The graph at m: a worker's (waited for; one not yet sent goes first in the queue),
        else, where no worker can, traced here."""
        key = (id(tracer), m)
        if key not in self.jobs and self.workers:
            self.queue = [(tracer, m)] + [(t, b) for t, b in self.queue if (id(t), b) != key]
            self._fill()
            while (tracer, m) in self.queue and self._read(block=True):  # every worker busy
                self._fill()
        job = self.jobs.pop(key, None)
        g = self._result(job) if job is not None else None
        self.received += g is not None
        if g is None:
            if job is not None:  # a worker failed: the rest is traced here (see _trace_job)
                self.close()
            g = tracer.trace(m)
            self.here += 1
        self._fill()
        return g

    def _fill(self) -> None:
        """Send queued traces to the workers, each its next one besides the one it traces
        (`_BACKLOG`): a worker goes on to it without waiting for this process to come back
        from costing. Breadth first: every worker's first before any worker's second."""
        self._read(block=False)
        for depth in range(_BACKLOG):
            for w in self.workers:
                if len(w.jobs) <= depth and self.queue:
                    tracer, m = self.queue.pop(0)
                    job = _Job.send(w, self._next, tracer, m)
                    self._next += 1
                    if job is not None:  # else (a source that cannot be pickled) traced here
                        self.jobs[(id(tracer), m)] = job

    def _read(self, block: bool) -> bool:
        """Take in the workers' reports (waiting for one where `block`); False when no
        worker is left."""
        busy = [w for w in self.workers if w.jobs]
        if not busy:
            return bool(self.workers)
        limit = stall_limit_s() if block else 0
        ready, _, _ = select.select([w.reports for w in busy], [], [], limit)
        if block and not ready:  # no worker has reported for the whole limit: stuck
            # one line beside the command line's progress (the workers are its machinery)
            print(
                f"gobrrr: no trace worker reported in {limit:g} s; tracing in this process "
                f"instead ({STALL_ENV} sets the limit)",
                file=sys.stderr,
                flush=True,
            )
            for w in busy:  # their jobs fail, and are traced here (`get`)
                for job in w.jobs:
                    job.status = -1
                w.jobs.clear()
                self.workers.remove(w)
                w.stop()
            return bool(self.workers)
        for w in busy:
            if w.reports in ready and not w.read():  # it died: its job is lost
                self.workers.remove(w)
                w.stop()
        return bool(self.workers)

    def _result(self, job: _Job) -> StepGraph | None:
        while job.status is None:
            if not job.worker.alive:
                break
            self._read(block=True)
            self._fill()
        try:
            with open(job.path, "rb") as f:
                data = f.read()
        finally:
            job.remove()
        return _unpickled(data) if job.status == 0 else None

    def close(self) -> None:
        """Stop the workers and remove the files of traces nobody asked for."""
        self.queue.clear()
        self._finalizer()
        self.workers = []


class _Worker:
    """A process forked before the planner's first backward that traces the jobs sent down
    its request pipe (`_work`) and reports (job id, status) up its report pipe."""

    def __init__(self, pid: int, requests: int, reports: int) -> None:
        self.pid, self.requests, self.reports = pid, requests, reports
        self.jobs: list[_Job] = []  # the job it is tracing, then those sent after it
        self.alive = True
        self._buf = b""

    @staticmethod
    def start() -> _Worker | None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = _fork()
        except OSError:  # no memory or processes left: trace here
            for fd in (req_r, req_w, rep_r, rep_w):
                os.close(fd)
            return None
        if pid == 0:
            os.close(req_w)
            os.close(rep_r)
            _work(req_r, rep_w)  # never returns
        os.close(req_r)
        os.close(rep_w)
        return _Worker(pid, req_w, rep_r)

    def read(self) -> bool:
        """Take in what the worker reported; False once it is gone."""
        chunk = os.read(self.reports, 4096)
        if not chunk:
            for job in self.jobs:
                job.status = -1
            self.jobs.clear()
            self.alive = False
            return False
        self._buf += chunk
        while len(self._buf) >= _REPORT.size:
            job, status = _REPORT.unpack(self._buf[: _REPORT.size])
            self._buf = self._buf[_REPORT.size :]
            if self.jobs and self.jobs[0].id == job:
                self.jobs.pop(0).status = status
        return True

    def stop(self) -> None:
        """Close its pipes (it exits when it reads the end) and reap it."""
        self.alive = False
        for fd in (self.requests, self.reports):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)  # a trace under way is not waited for
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


#: traces sent to a worker at once: the one it traces and the next
_BACKLOG = 2

#: How much lower a trace worker's CPU priority is than the planner's (os.nice): where the
#: cores are all busy, the planner's costing (which the answer waits on) runs first and the
#: workers trace on what it leaves; an idle planner (waiting for a trace) leaves them all.
WORKER_NICE = 5

_REPORT = struct.Struct("<qi")  # (job id, status: 0 traced, 1 failed)
_LENGTH = struct.Struct("<Q")


class _Job:
    """One trace sent to a worker: its id, the file the worker writes, its status once done."""

    def __init__(self, job: int, path: str, worker: _Worker) -> None:
        self.id, self.path, self.worker = job, path, worker
        self.status: int | None = None

    @staticmethod
    def send(worker: _Worker, job_id: int, tracer: Tracer, m: int) -> _Job | None:
        spec = (tracer.source, tracer.seq, tracer.precision, tracer.target, tracer.variant, m)
        try:
            payload = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - e.g. a lambda as the source: traced here
            return None
        fd, path = tempfile.mkstemp(prefix="gobrrr-trace-", suffix=".pickle")
        with os.fdopen(fd, "wb") as f:  # the spec (a calibration: more than a pipe holds)
            f.write(payload)
        message = pickle.dumps((job_id, path))
        try:
            os.write(worker.requests, _LENGTH.pack(len(message)) + message)
        except OSError:  # the worker is gone
            os.unlink(path)
            return None
        job = _Job(job_id, path, worker)
        worker.jobs.append(job)
        return job

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def _work(requests: int, reports: int) -> None:
    """A worker's loop: trace each job read, write its graph to the job's file and report
    it; exit when the planner closes the pipe."""
    gc.freeze()  # the heap inherited from the planner: never walked by the collector here
    try:  # the planner's costing waits on nothing but its own work: it goes first
        os.nice(WORKER_NICE)
    except OSError:
        pass
    buf = b""
    try:
        while True:
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                break
            buf += chunk
            while len(buf) >= _LENGTH.size:
                n = _LENGTH.unpack(buf[: _LENGTH.size])[0]
                if len(buf) < _LENGTH.size + n:
                    break
                job, path = pickle.loads(buf[_LENGTH.size : _LENGTH.size + n])
                buf = buf[_LENGTH.size + n :]
                with open(path, "rb") as f:
                    payload = f.read()
                status = _trace_job(payload, path)
                os.write(reports, _REPORT.pack(job, status))
    finally:
        os._exit(0)


def _trace_job(payload: bytes, path: str) -> int:
    """In a worker: the trace a job asks for, pickled into `path` with its warnings; 0 when
    it was, 1 when it raised (the planner traces it again and reports the error; and traces
    the rest itself, since a worker forked after a backward in the planner's process, where
    the API was called after training, say, fails every trace at its first backward)."""
    try:
        source, seq, precision, target, variant, m = pickle.loads(payload)
        tracer = Tracer(source, seq=seq, precision=precision, target=target, variant=variant)
        with warnings.catch_warnings(record=True) as caught:
            g = tracer.trace(m)
        said = [(w.message, w.category, w.filename, w.lineno) for w in caught]
        with open(path, "wb") as f:
            pickle.dump((g, said), f, protocol=pickle.HIGHEST_PROTOCOL)
        return 0
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - traced again by the planner, which reports it
        if os.environ.get("GOBRRR_DEBUG"):
            traceback.print_exc()
        return 1


def _shut(workers: list, jobs: dict) -> None:
    for job in jobs.values():
        job.remove()
    jobs.clear()
    for w in workers:
        w.stop()


def uses_torchscript(model: torch.nn.Module) -> bool:
    """Whether the model's code calls TorchScript: a scripted module, or a scripted function
    in the globals of a module class's source (HF DeBERTa's attention helpers)."""
    seen: set[str] = set()
    for mod in model.modules():
        if isinstance(mod, torch.jit.ScriptModule):
            return True
        name = type(mod).__module__
        if name in seen:
            continue
        seen.add(name)
        found = vars(sys.modules[name]).values() if name in sys.modules else ()
        if any(isinstance(v, torch.jit.ScriptFunction) for v in found):
            return True
    return False


def forked_map(fns: list[Callable[[], Any]], processes: int) -> list[Any]:
    """[fn() for fn in fns], the first here and up to `processes` of the others in forked
    children meanwhile (the rest here after it, before waiting for the children); a child
    that fails is run again here, which raises its error here. Each fn must leave this
    process's state as it found it (what it changes in a child is lost): its result is what
    counts."""
    forked = fns[1 : 1 + processes]
    children = [_Child.fork(fn) for fn in forked]
    out = [fns[0]()]
    rest = [fn() for fn in fns[1 + processes :]]
    for fn, child in zip(forked, children, strict=True):
        got = child.result() if child is not None else None
        out.append(fn() if got is None else got)
    return out + rest


def _run_child(fn: Callable[[], Any], fd: int) -> None:
    """In the forked child: fn(), its result and warnings written to `fd`, then exit without
    running the parent's exit handlers or flushing its buffers (they are the parent's)."""
    code = 1
    gc.freeze()  # the heap inherited from the parent: never walked by the collector here
    try:
        with warnings.catch_warnings(record=True) as caught:
            value = fn()
        said = [(w.message, w.category, w.filename, w.lineno) for w in caught]
        with os.fdopen(fd, "wb", closefd=False) as f:
            pickle.dump((value, said), f, protocol=pickle.HIGHEST_PROTOCOL)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent runs it again and reports it
        if os.environ.get("GOBRRR_DEBUG"):
            traceback.print_exc()
    finally:
        os._exit(code)


class _Child:
    """One process forked from this one to run fn() (no autograd in it: see `Ahead`), its
    result pickled into a file of its own."""

    def __init__(self, pid: int, path: str) -> None:
        self.pid, self.path = pid, path

    @staticmethod
    def fork(fn: Callable[[], Any]) -> _Child | None:
        fd, path = tempfile.mkstemp(prefix="gobrrr-trace-", suffix=".pickle")
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = _fork()
        except OSError:
            os.close(fd)
            os.unlink(path)
            return None
        if pid == 0:
            _run_child(fn, fd)  # never returns
        os.close(fd)
        return _Child(pid, path)

    def result(self) -> Any:
        """fn()'s result, its warnings raised here; None where the child failed."""
        _, status = os.waitpid(self.pid, 0)
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        finally:
            os.unlink(self.path)
        return _unpickled(data) if status == 0 else None


def _fork() -> int:
    """os.fork, without Python 3.12's warning that forking a process with threads may
    deadlock: the threads here are idle library pools (OpenBLAS), and a worker is forked
    before autograd starts its own (see `Ahead`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _unpickled(data: bytes) -> Any:
    """What a child wrote (`_run_child`): its result, its warnings raised here (None for an
    empty file)."""
    if not data:
        return None
    value, caught = pickle.loads(data)
    for message, category, filename, lineno in caught:
        warnings.warn_explicit(message, category, filename, lineno)
    return value


#: seconds the planner waits for a trace worker to report before it gives up on it
STALL_ENV = "GOBRRR_TRACE_TIMEOUT"
DEFAULT_STALL_S = 900.0


def stall_limit_s() -> float:
    """How long a blocked planner waits without a word from any busy trace worker (a trace
    takes seconds, a 70B one ~15 s on 2 cores): GOBRRR_TRACE_TIMEOUT where set, else 900."""
    env = os.environ.get(STALL_ENV, "").strip()
    if not env:
        return DEFAULT_STALL_S
    try:
        value = float(env)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise GobrrrError(
            f"{STALL_ENV}={env!r}: give the seconds the planner waits for a trace worker, a "
            "positive number (unset: 900)"
        )
    return value


def processes_to_spare() -> int:
    """How many worker processes trace ahead: GOBRRR_TRACE_PROCESSES where set (0: none), else
    the cores this process may use (it mostly waits for them, or costs meanwhile), at most
    MAX_WORKERS (each holds a trace's graph); 0 where there is one core, or no fork."""
    if not hasattr(os, "fork"):
        return 0
    env = os.environ.get("GOBRRR_TRACE_PROCESSES", "").strip()
    if env:
        if not env.isdigit():
            raise GobrrrError(
                f"GOBRRR_TRACE_PROCESSES={env!r}: give a whole number of processes (0: trace "
                "in this process only)"
            )
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cores or 1, MAX_WORKERS) if (cores or 1) > 1 else 0


#: Worker processes at most by default: a plan traces 3 micro-batches per variant, and a
#: worker holds its latest trace's graph (GBs for a 70B model at long sequences).
MAX_WORKERS = 4


def _cut(w: Workload, m: int) -> Workload:
    """A copy of `w` with its batch's first m samples (tokens scaled to match); `w` itself,
    which may be the user's own Workload, is left whole for the next micro-batch."""
    full = samples(w)
    if m > full:
        raise GobrrrError(
            f"the workload's batch is fixed at {full} samples, so no micro-batch of "
            f"{m} can be cut from it: make the global batch at most {full}, or give "
            "a function that takes batch_size (see README, `plan`)"
        )
    w = copy.copy(w)
    w.batch = map_tensors(w.batch, lambda t: t[:m].clone() if t.dim() and t.shape[0] == full else t)
    if w.tokens is not None:
        w.tokens = w.tokens * m // full
    return w
