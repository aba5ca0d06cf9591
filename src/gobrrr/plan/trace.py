"""Tracing a workload at a chosen micro-batch, for the planner."""

from __future__ import annotations

import copy
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
from gobrrr.capture.sdpa import target_for
from gobrrr.errors import GobrrrError
from gobrrr.estimate import workload_factory
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Target
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.probe import samples
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
        """Trace the step at `micro_batch` in this process."""
        make = self._variant(self._maker(micro_batch))
        return capture(
            make,
            precision=self.variant.precision(self.precision),
            sdpa=target_for(self.target.gpu.full_name),
            compile=self.variant.compile,
        )

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
        traced as gobrrr.training.offload's stand-in)."""
        v = self.variant
        if not v.fused_loss and v.optimizer_states == "as-is" and not v.offload:
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
            user = w.optimizer or (lambda ps: torch.optim.AdamW(ps, lr=3e-4))
            if v.offload:
                w.optimizer = lambda ps: stand_in(user(ps))
            elif v.optimizer_states != "as-is":
                w.optimizer = lambda ps: traced_states_optimizer(user(ps), v.optimizer_states)
            return w

        return build


class Ahead:
    """Traces run ahead in other processes, at most `processes` at once: a trace is seconds
    of single-threaded Python over fake tensors, each independent of the others, so on a
    machine with cores to spare the planner's traces overlap one another and its costing.

    The children are forked by a server process that this one forks when the planner starts,
    before its first backward: autograd refuses to run in a child forked after its parent
    ran one (its worker threads do not survive a fork), and the server never runs one. A
    child traces as this process's first trace would, with the same code, and hands the
    StepGraph back pickled with the warnings it raised (raised here again). A trace that fails
    in a child is traced again here, which raises its error where the search meets it.

    Not for a model whose code calls TorchScript functions (`uses_torchscript`): a process's
    first run of those differs from its later ones (see `passes.microbatch.family`), and a
    child's trace is always its process's first. The workload function runs in the child:
    side effects it has (a counter, a print) happen there, so the Python API leaves this off
    (`Planner(ahead=0)`) and the command line, whose process is gobrrr's own, turns it on.
    """

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.queue: list[tuple[Tracer, int]] = []
        self.jobs: dict[tuple[int, int], _Job] = {}  # (id(tracer), m) -> its job
        self.received = 0  # traces a child made
        self.here = 0  # traces made in this process (its autograd threads then exist)
        self._tracers: dict[int, Tracer] = {}  # kept alive while their ids key jobs
        self.server = _Server.start() if processes > 0 else None
        self._finalizer = weakref.finalize(self, _shut, self.server, self.jobs)

    def expect(self, tracer: Tracer, micro_batches: Iterable[int]) -> None:
        for m in micro_batches:
            key = (id(tracer), m)
            if key not in self.jobs and (tracer, m) not in self.queue:
                self._tracers[id(tracer)] = tracer
                self.queue.append((tracer, m))
        self._fill()

    def get(self, tracer: Tracer, m: int) -> StepGraph:
        """The graph at m: a child's where one traced (or is tracing) it, else traced here
        (a queued one is taken off the queue)."""
        key = (id(tracer), m)
        self.queue = [(t, b) for t, b in self.queue if (id(t), b) != key]
        job = self.jobs.pop(key, None)
        g = job.result(self.server) if job is not None and self.server is not None else None
        self.received += g is not None
        if g is None:
            g = tracer.trace(m)
            self.here += 1
        self._fill()
        return g

    def _fill(self) -> None:
        """Start queued traces while fewer than `processes` are under way."""
        if self.server is None:
            return
        self.server.poll()
        busy = sum(1 for j in self.jobs.values() if not self.server.finished(j.id))
        while self.queue and busy < self.processes:
            tracer, m = self.queue.pop(0)
            job = _Job.submit(self.server, tracer, m)
            if job is None:  # a tracer that cannot be sent (a lambda, say): traced here
                continue
            self.jobs[(id(tracer), m)] = job
            busy += 1

    def close(self) -> None:
        """Stop the server and the traces nobody asked for, and remove their files."""
        self.queue.clear()
        self._finalizer()
        self.server = None


class _Server:
    """A process that forks one child per trace asked of it (`_serve`), forked before the
    planner's first backward. Jobs go down one pipe, pickled; (job id, exit status) of each
    finished child come back up another."""

    def __init__(self, pid: int, requests: int, reports: int) -> None:
        self.pid, self.requests, self.reports = pid, requests, reports
        self.done: dict[int, int] = {}  # job id -> the child's exit status
        self._buf = b""
        self.next_id = 0

    @staticmethod
    def start() -> _Server | None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:  # no memory or processes left: trace here
            for fd in (req_r, req_w, rep_r, rep_w):
                os.close(fd)
            return None
        if pid == 0:
            os.close(req_w)
            os.close(rep_r)
            _serve(req_r, rep_w)  # never returns
        os.close(req_r)
        os.close(rep_w)
        return _Server(pid, req_w, rep_r)

    def send(self, message: bytes) -> bool:
        try:
            os.write(self.requests, struct.pack("<Q", len(message)) + message)
        except OSError:  # the server is gone
            return False
        return True

    def poll(self, block: bool = False) -> bool:
        """Read the reports that arrived (waiting for one if `block`); False once the
        server is gone."""
        while True:
            ready, _, _ = select.select([self.reports], [], [], None if block else 0)
            if not ready:
                return True
            chunk = os.read(self.reports, 4096)
            if not chunk:
                return False
            self._buf += chunk
            while len(self._buf) >= _REPORT.size:
                job, status = _REPORT.unpack(self._buf[: _REPORT.size])
                self._buf = self._buf[_REPORT.size :]
                self.done[job] = status
            block = False

    def finished(self, job: int) -> bool:
        return job in self.done

    def wait(self, job: int) -> int | None:
        """The exit status of the job's child (None: the server is gone)."""
        while job not in self.done:
            if not self.poll(block=True):
                return None
        return self.done.pop(job)

    def stop(self) -> None:
        """Close the request pipe (the server kills its children and exits) and reap it."""
        for fd in (self.requests, self.reports):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


_REPORT = struct.Struct("<qi")  # (job id, exit status)


class _Job:
    """One trace asked of the server: its id and the file its child writes."""

    def __init__(self, job: int, path: str) -> None:
        self.id, self.path = job, path

    @staticmethod
    def submit(server: _Server, tracer: Tracer, m: int) -> _Job | None:
        spec = (tracer.source, tracer.seq, tracer.precision, tracer.target, tracer.variant, m)
        try:
            payload = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - e.g. a lambda as the source: traced here
            return None
        fd, path = tempfile.mkstemp(prefix="gobrrr-trace-", suffix=".pickle")
        os.close(fd)
        job = _Job(server.next_id, path)
        server.next_id += 1
        if not server.send(pickle.dumps((job.id, path, payload))):
            os.unlink(path)
            return None
        return job

    def result(self, server: _Server) -> StepGraph | None:
        """The child's graph, its warnings raised here; None where it failed."""
        status = server.wait(self.id)
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        finally:
            self.remove()
        return _unpickled(data) if status == 0 else None

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def _serve(requests: int, reports: int) -> None:
    """The server's loop: fork a child per job read, report each child's exit; when the
    planner closes the pipe (or is gone), kill what still runs and exit."""
    children: dict[int, int] = {}  # pid -> job id
    buf = b""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the planner handles Ctrl-C
        while True:
            ready, _, _ = select.select([requests], [], [], 0.01 if children else None)
            if ready:
                chunk = os.read(requests, 1 << 16)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 8 and len(buf) >= 8 + struct.unpack("<Q", buf[:8])[0]:
                    n = struct.unpack("<Q", buf[:8])[0]
                    job, path, payload = pickle.loads(buf[8 : 8 + n])
                    buf = buf[8 + n :]
                    pid = os.fork()
                    if pid == 0:
                        os.close(requests)
                        os.close(reports)
                        signal.signal(signal.SIGINT, signal.SIG_DFL)
                        _trace_job(payload, path)  # never returns
                    children[pid] = job
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if not pid:
                    break
                os.write(reports, _REPORT.pack(children.pop(pid), status))
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os._exit(0)


def _trace_job(payload: bytes, path: str) -> None:
    """In a child of the server: the trace a job asks for, written to `path`."""

    def trace() -> StepGraph:
        source, seq, precision, target, variant, m = pickle.loads(payload)
        return Tracer(source, seq=seq, precision=precision, target=target, variant=variant).trace(m)

    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    _run_child(trace, fd)


def _shut(server: _Server | None, jobs: dict) -> None:
    for job in jobs.values():
        job.remove()
    jobs.clear()
    if server is not None:
        server.stop()


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
    children meanwhile (the rest here after it); a child that fails is run again here, which
    raises its error here. Each fn must leave this process's state as it found it (what it
    changes in a child is lost): its result is what counts."""
    children = [_Child.fork(fn) for fn in fns[1 : 1 + processes]]
    out = [fns[0]()]
    for fn, child in zip(fns[1:], children + [None] * len(fns), strict=False):
        got = child.result() if child is not None else None
        out.append(fn() if got is None else got)
    return out


def _run_child(fn: Callable[[], Any], fd: int) -> None:
    """In the forked child: fn(), its result and warnings written to `fd`, then exit without
    running the parent's exit handlers or flushing its buffers (they are the parent's)."""
    code = 1
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
            pid = os.fork()
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


def _unpickled(data: bytes) -> Any:
    """What a child wrote (`_run_child`): its result, its warnings raised here (None for an
    empty file)."""
    if not data:
        return None
    value, caught = pickle.loads(data)
    for message, category, filename, lineno in caught:
        warnings.warn_explicit(message, category, filename, lineno)
    return value


def processes_to_spare() -> int:
    """How many traces may run ahead at once here: GOBRRR_TRACE_PROCESSES where set (0: none),
    else the cores this process may use (it waits for its children, or costs meanwhile), 0
    where there is one core, or no fork."""
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
    return (cores or 1) if (cores or 1) > 1 else 0


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
