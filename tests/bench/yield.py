"""Yield benchmark: does training traffic keep the link while something pulls weights beside it?

Issue 12's table (and issue 23's burst rows), in one run, with wagent's SHIPPED DEFAULTS ONLY:
the policy names the interface, the link's rate and ``training_ports: [29500]``, as a user writes
it. On the testbed: an origin serving a generated model with nginx, a 1 Gbit/s bottleneck
(``--link``) upstream of the pulling node (HTB and a queue on the origin's egress: a switch queue
the node's own caps can't reach; ``--queue shallow``, the default, is a 50 ms bfifo, ``--queue
deep`` a pfifo of 1000 packets, up to 64 MB), iperf3 servers and a burst sender on the origin, so
training data flows origin -> node like the pull's.

Each scenario runs with three pullers beside it, each started afresh (its own store):

- ``wagent``: ``wagent pull --policy P`` with the shipped defaults;
- ``aria2c -j8``: a peer tool that yields to nothing;
- ``backoff off``: the same wagent pull with ``backoff: {enabled: false}`` (shaping on, no yield).

Scenarios (``--scenarios``, default all three): ``listed``, a sustained 20 s flow (iperf3 -R) on
the listed port 29500; ``unlisted``, the same on an unlisted port; ``bursts``, all-reduce-like
bursts on an unlisted port, acked by the receiver (tests/testbed/bursts.py), once per
``--pattern SIZE@GAP`` (SIZE sent, then GAP seconds idle; default 24MB@0.5). Measured: the
training's rate or burst times vs alone; the pull alone (the seconds before the training starts);
the pull's goodput while the bursts run, as a share of the idle capacity between them; the
puller's CPU time over the bursts (its whole process tree, all threads, as a share of one core);
the time the pull takes, after a sustained flow ends, to be back at 80% of the link. A puller
that finishes the model within a scenario starts again on an empty store (a new process that
knows nothing of the training yet): the burst it meets first counts as a first (marked * in the
per-burst lists), not among the p50 and p99 of the bursts after the first. References
are measured in the same run: the flow alone (before and after the pullers, their mean; before
only when no flow scenario runs) and the bursts alone, for each pattern.

``--until-done`` ("training all the time"): in the bursts scenario the bursts start first and
the puller (run once, not restarted) starts beside them; they go on until the pull has the whole
model (at most 600 s). Reported: the pull's completion time, the ideal (the model over the idle
capacity between bursts alone: size * 8 / (link * gap / (gap + the burst's p50 alone))) and their
ratio; the burst figures then cover the bursts during the pull.

A sampler inside the node reads every TCP socket's received bytes through sock_diag every 100 ms,
so the pull's rate is measured apart from what wagent reports about itself; it runs in every
run, references included, so each carries the same measuring load.

    python tests/bench/yield.py               # 20 s flows, 30 bursts, a 4 GB model (~8 min)
    python tests/bench/yield.py --quick       # 8 s flows, 12 bursts, 2.5 GB
    python tests/bench/yield.py --cc cubic    # the senders' congestion control (default: the
                                              # machine's), set on the origin's route
    python tests/bench/yield.py --scenarios bursts --queue deep \\
        --pattern 6MB@0.12 --pattern 24MB@0.5 --pattern 48MB@1.2     # issue 23's burst rows
    python tests/bench/yield.py --scenarios bursts --until-done --model-size 4GB \\
        --pattern 24MB@0.5                    # training all the time: how long the pull takes

Needs root. The model lives in a tmpfs (/dev/shm), the pulled copies on disk (/var/tmp); all are
deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.backoff_helpers import SHIPPED_POLICY  # noqa: E402

LINK = 10**9                     # --link
LINK_TEXT = "1gbit"              # as the policy says it
DIST_PORT = 8080
LISTED, UNLISTED, BURST_PORT = 29500, 41000, 41001
TRAINING_PORTS = (LISTED, UNLISTED, BURST_PORT)
SAMPLE_EVERY = 0.1
MODEL, VERSION = "yieldmodel", "v1"
BURST_SIZE, BURST_GAP = 24 * 10**6, 0.5   # the default --pattern
BACK_SHARE = 0.8                 # "back": the pull at 80% of the link, over half a second
PULLERS = ("wagent", "aria2c -j8", "backoff off")
SCENARIOS = ("listed", "unlisted", "bursts")
# --queue: the bottleneck's leaf (tests/testbed/bed.py) and how the table names it.
QUEUES = {"shallow": ("bfifo", "a 50 ms bfifo"), "deep": ("pfifo", "a pfifo of 1000 packets")}
UNTIL_DONE_CAP = 600.0           # --until-done: the longest a pull may take beside the bursts
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Pattern:
    """Bursts of ``size`` bytes, each followed by ``gap`` seconds idle."""

    size: int
    gap: float

    @property
    def label(self) -> str:
        return f"{self.size / 1e6:g}MB@{self.gap:g}"

    @property
    def alone_s(self) -> float:
        """A burst's time alone at the link's rate, without round trips."""
        return self.size * 8 / LINK


def parse_pattern(text: str) -> Pattern:
    """``--pattern SIZE@GAP``: ``24MB@0.5``."""
    from agent.units import parse_size

    size, sep, gap = text.partition("@")
    try:
        pattern = Pattern(parse_size(size), float(gap))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: want SIZE@GAP, e.g. 24MB@0.5 ({e})") from None
    if not sep or pattern.size <= 0 or pattern.gap < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want SIZE@GAP, e.g. 24MB@0.5")
    return pattern


# --- the puller's CPU, from /proc ------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, own ticks, reaped children's ticks) of ``pid``: /proc/PID/stat's utime + stime
    (every thread of the process) and cutime + cstime; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = text[text.rindex(")") + 2:].split()      # f[0] is field 3 (state): field n is f[n - 3]
    return int(f[1]), int(f[11]) + int(f[12]), int(f[13]) + int(f[14])


def tree_cpu(root: int) -> float | None:
    """CPU seconds of everything ``root`` started, live or reaped; None if ``root`` is gone.

    The root (the puller's ``sh`` loop) only waits, so its own time is left out; the children it
    reaped (a wagent that finished, and the loop's rm) are in its cutime, the live ones are
    walked through /proc (their reaped children in their own cutime).
    """
    stats: dict[int, tuple[int, int, int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _proc_stat(int(d))) is not None:
            stats[int(d)] = st
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    ticks = stats[root][2]
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        ticks += stats[pid][1] + stats[pid][2]
        todo += children.get(pid, [])
    return ticks / CLK_TCK


def idle_between(bursts: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``start``-``end`` that no burst (its first write to its ack) covers."""
    busy = sum(max(0.0, min(b1, end) - max(b0, start)) for b0, b1 in bursts)
    return (end - start) - busy



# --- the sampler, run inside the node's namespace --------------------------------------------
def sampler(interval: float) -> None:
    """Print ``monotonic dist_bytes training_bytes`` every ``interval`` until SIGTERM."""
    from agent.yielding.detect.sockdiag import dump_tcp

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    last: dict[tuple, int] = {}
    dist = train = 0
    while True:
        now = time.monotonic()
        seen: dict[tuple, int] = {}
        for s in dump_tcp():
            port = s.remote[1]
            if s.bytes_received is None or (port != DIST_PORT and port not in TRAINING_PORTS):
                continue
            key = (s.local, s.remote, s.inode)
            seen[key] = s.bytes_received
            moved = max(0, s.bytes_received - last.get(key, 0))
            if port == DIST_PORT:
                dist += moved
            else:
                train += moved
        last = seen
        print(f"{now:.4f} {dist} {train}", flush=True)
        time.sleep(max(0.0, interval - (time.monotonic() - now)))


@dataclass
class Samples:
    t: list[float]
    dist: list[int]
    train: list[int]

    @classmethod
    def read(cls, path: Path) -> Samples:
        t, d, r = [], [], []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                t.append(float(parts[0]))
                d.append(int(parts[1]))
                r.append(int(parts[2]))
        return cls(t, d, r)

    def _at(self, t: float) -> int:
        for k, tk in enumerate(self.t):
            if tk >= t:
                return k
        return len(self.t) - 1

    def bytes(self, series: list[int], start: float, end: float) -> int:
        return series[self._at(end)] - series[self._at(start)]

    def rate(self, series: list[int], start: float, end: float) -> float:
        """Bits/s of ``series`` between the samples nearest ``start`` and ``end``."""
        i, j = self._at(start), self._at(end)
        if j <= i:
            return 0.0
        return (series[j] - series[i]) * 8 / (self.t[j] - self.t[i])

    def back_after(self, start: float, share: float, within: float) -> float | None:
        """Seconds from ``start`` until the pull runs at ``share`` of the link over 0.5 s."""
        k = start
        while k < start + within:
            if self.rate(self.dist, k, k + 0.5) >= share * LINK:
                return k - start
            k += SAMPLE_EVERY
        return None


# --- results -----------------------------------------------------------------------------------
@dataclass
class Flow:
    mean: float                           # bits/s over the whole flow
    first: float                          # its first second
    after1: float                         # after its first second
    intervals: list[float]                # per second
    pull: float | None = None             # the pull's bits/s while the flow ran (after 1 s)
    back_after: float | None = None       # s from its end until the pull is back (see above)


@dataclass
class Bursts:
    seconds: list[float]                  # each burst, first to ack
    pull_share: float | None = None       # pull's goodput / idle capacity between bursts
    cpu: float | None = None              # puller's CPU seconds / wall seconds over the bursts
    done_after: float | None = None       # --until-done: s from the puller's start to its exit 0
    ideal: float | None = None            # --until-done: model / idle capacity between bursts
    # Bursts that were a pull's first: the first of the run, and the first a puller met after
    # it finished the model and started again (a new `wagent pull` process knows nothing of
    # the training yet, as the first did): counted as firsts, not among the p50 and p99.
    firsts: list[int] = field(default_factory=lambda: [0])     # a list: the JSON has it too

    def _after_first(self) -> list[float]:
        rest = [s for i, s in enumerate(self.seconds) if i not in self.firsts]
        return rest or self.seconds

    @property
    def first(self) -> float:
        return max(self.seconds[i] for i in self.firsts)

    @property
    def p50(self) -> float:
        return statistics.median(self._after_first())

    def p99(self, after_first: bool = True) -> float:
        s = sorted(self._after_first() if after_first else self.seconds)
        return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


@dataclass
class PullerRun:
    listed: Flow | None = None
    unlisted: Flow | None = None
    bursts: dict[str, Bursts] = field(default_factory=dict)   # by Pattern.label
    alone: list[float] = field(default_factory=list)   # pull alone, bits/s, each warm-up
    load: list[str] = field(default_factory=list)      # 1-min load average after each scenario
    notes: list[str] = field(default_factory=list)


def restart_times(log: str, offset: float) -> list[float]:
    """When a puller's loop started the pull again (its RESTARTED lines carry the wall clock),
    on this process's monotonic clock (``offset``: wall minus monotonic, taken now).

    >>> restart_times("x\\nRESTARTED 1000.5\\nRESTARTED\\n", 900.0)
    [100.5]
    """
    out = []
    for line in log.splitlines():
        parts = line.split()
        if parts[:1] == ["RESTARTED"] and len(parts) == 2:
            with contextlib.suppress(ValueError):
                out.append(float(parts[1]) - offset)
    return out


# --- the benchmark ----------------------------------------------------------------------------
class Bench:
    def __init__(self, tb: object, shm: Path, files: list[Path], seconds: float, bursts: int,
                 warmup: float, recovery: float, leaf: str = "bfifo") -> None:
        from tests.testbed import WAGENT

        self.tb, self.shm, self.files = tb, shm, files
        self.model_bytes = sum(p.stat().st_size for p in files)
        self.seconds, self.count = seconds, bursts
        self.warmup, self.recovery = warmup, recovery
        self.wagent = WAGENT
        self.t0_bps = float(LINK)
        self.b0: dict[str, Bursts] = {}
        self._burst_times: list[tuple[float, float]] = []
        self.origin, self.node = tb.host("origin"), tb.host("node")  # type: ignore[attr-defined]
        self.link = tb.connect(self.origin, self.node, rate=LINK,  # type: ignore[attr-defined]
                               leaf=leaf)

    def setup(self, cc: str | None) -> None:
        if cc:
            # The senders' congestion control (iperf3's, nginx's, the bursts'): a route
            # attribute on the origin, which a namespace may set for any algorithm the kernel
            # has (its default sysctl is limited to tcp_allowed_congestion_control).
            self.origin.run(["ip", "route", "replace", f"{self.link.b.ip4}/32", "dev",
                             self.link.a.ifname, "congctl", cc])
        srv = self.tb.nginx(self.origin, root=self.shm / "origin", port=DIST_PORT)  # type: ignore
        self.base = srv.url_for(self.link.a)
        for port in (LISTED, UNLISTED):
            self.tb.iperf3_server(self.origin, port=port)  # type: ignore[attr-defined]

    # -- training traffic -----------------------------------------------------------------------
    def flow(self, port: int) -> tuple[Flow, float, float]:
        res = None
        t0 = time.monotonic()
        res = self.tb.iperf3(self.node, server=self.link.a.ip4, port=port,  # type: ignore
                             seconds=self.seconds, reverse=True)
        t1 = time.monotonic()
        iv = [r for _, _, r in res.intervals]
        later = iv[1:] or iv
        return Flow(res.bps, iv[0] if iv else 0.0, sum(later) / len(later), iv), t0, t1

    def bursts(self, pattern: Pattern) -> Bursts:
        # At most as long as the bursts take alone, with a little room (with a puller that
        # doesn't yield, a burst takes seconds: fewer of them fit). 24MB@0.5 keeps the 0.25 s
        # per burst it always had; a longer burst gets 1.3x its time at the link's rate.
        per = pattern.gap + max(0.25, 1.3 * pattern.alone_s)
        got = self.tb.bursts(self.origin, self.node, server=self.link.a.ip4,  # type: ignore
                             port=BURST_PORT, size=pattern.size, gap=pattern.gap,
                             count=self.count, seconds=self.count * per).result()
        self._burst_times = [(b.started, b.started + b.seconds) for b in got]
        return Bursts([b.seconds for b in got])

    # -- pullers --------------------------------------------------------------------------------
    def start_puller(self, name: str, once: bool = False) -> tuple[subprocess.Popen, Path]:
        store = Path(tempfile.mkdtemp(prefix="wagent-yield-store-", dir="/var/tmp"))
        self.policy = None
        if name == "aria2c -j8":
            listing = self.shm / "aria2c.list"
            listing.write_text("".join(f"{self.base}/{MODEL}/{VERSION}/{p.name}\n"
                                       for p in self.files))
            argv = ["aria2c", "-j8", "-q", "--dir", str(store), "--input-file", str(listing),
                    "--file-allocation=none", "--allow-overwrite=true",
                    "--auto-file-renaming=false"]
        else:
            state = Path(tempfile.mkdtemp(prefix="state-", dir=self.shm))
            text = SHIPPED_POLICY.format(store=store, ifname=self.link.b.ifname, state=state)
            text = text.replace("link_rate: 1gbit", f"link_rate: {LINK_TEXT}")
            if name == "backoff off":
                text = text.replace("backoff:\n", "backoff:\n  enabled: false\n")
            policy = self.policy = state / "policy.yaml"
            policy.write_text(text)
            argv = [self.wagent, "-v", "pull", f"{self.base}/{MODEL}/{VERSION}", "--store",
                    str(store), "--policy", str(policy), "-q"]
        if once:
            # --until-done: one pull; the shell then becomes a sleep, so its cutime (the pull's
            # CPU) can still be read from /proc after the pull exits.
            loop = '"$@"; echo "EXITED $?"; exec sleep 86400'
        else:
            # A puller that yields to nothing may finish the model within a scenario: it starts
            # again on an empty store, so the scenario keeps something pulling beside it (and
            # the log says so: RESTARTED lines).
            loop = (f'while :; do "$@"; echo RESTARTED $(date +%s.%N); rm -rf {store}; '
                    f'mkdir -p {store}; done')
        proc = self.node.popen(["sh", "-c", loop, "puller", *argv],  # type: ignore[attr-defined]
                               log=f"yield-{name.split()[0]}")
        return proc, store

    def scenario(self, name: str, run: PullerRun, what: str,
                 pattern: Pattern | None = None) -> None:
        sproc, slog = start_sampler(self.node)
        puller, store = self.start_puller(name)
        try:
            time.sleep(self.warmup)
            if puller.poll() is not None or "RESTARTED" in Path(puller.log_path).read_text(
                    errors="replace"):
                raise RuntimeError(f"{name} ended during the warm-up:\n"
                                   + Path(puller.log_path).read_text(errors="replace")[-3000:])
            t_ready = time.monotonic()
            cpu0 = tree_cpu(puller.pid)
            if what == "bursts":
                assert pattern is not None
                b = self.bursts(pattern)
                t_end = time.monotonic()
                cpu1 = tree_cpu(puller.pid)
            else:
                f, t0, t_end = self.flow(LISTED if what == "listed" else UNLISTED)
            time.sleep(self.recovery)
        finally:
            self.stop_puller(puller, store)
            stop(sproc)
        log = Path(puller.log_path).read_text(errors="replace")
        restarted = restart_times(log, time.time() - time.monotonic())
        label = what if pattern is None else f"{what} {pattern.label}"
        if "RESTARTED" in log:
            run.notes.append(f"{label}: {name} finished the model and started again "
                             f"{log.count('RESTARTED')}x")
        s = Samples.read(slog)
        run.alone.append(s.rate(s.dist, t_ready - 3.0, t_ready - 0.1))
        run.load.append(Path("/proc/loadavg").read_text().split()[0])
        if what == "bursts":
            assert pattern is not None
            starts = self._burst_times
            idle = idle_between(starts, starts[0][0], starts[-1][1])
            pulled = s.bytes(s.dist, starts[0][0], starts[-1][1]) * 8
            b.pull_share = pulled / (self.t0_bps * idle) if idle > 0 else None
            for at in restarted:
                # the burst under way when the new pull started, or the next one
                met = [i for i, (_, end) in enumerate(starts) if end >= at]
                if met and met[0] not in b.firsts:
                    b.firsts.append(met[0])
            if cpu0 is not None and cpu1 is not None:
                b.cpu = (cpu1 - cpu0) / (t_end - t_ready)
            run.bursts[pattern.label] = b
        else:
            f.pull = s.rate(s.dist, t0 + 1.0, t_end - 0.2)
            f.back_after = s.back_after(t_end, BACK_SHARE, self.recovery - 0.5)
            if what == "listed":
                run.listed = f
            else:
                run.unlisted = f

    def until_done(self, name: str, run: PullerRun, pattern: Pattern) -> None:
        """Training all the time: bursts first, then one pull beside them until it is done."""
        from tests.testbed.bursts import parse

        sproc, slog = start_sampler(self.node)
        flow = self.tb.bursts(self.origin, self.node, server=self.link.a.ip4,  # type: ignore
                              port=BURST_PORT, size=pattern.size, gap=pattern.gap,
                              count=10**9, seconds=UNTIL_DONE_CAP + 30.0)
        puller: subprocess.Popen | None = None
        store: Path | None = None
        rc: int | None = None
        try:
            # Two periods of bursts first, so the pull starts into a training that runs.
            time.sleep(2 * (pattern.gap + max(0.25, 1.3 * pattern.alone_s)))
            t_start = time.monotonic()
            puller, store = self.start_puller(name, once=True)
            log = Path(puller.log_path)
            while time.monotonic() < t_start + UNTIL_DONE_CAP:
                if (rc := exited(log)) is not None or puller.poll() is not None:
                    break
                time.sleep(0.05)
            t_done = time.monotonic()
            cpu = tree_cpu(puller.pid)
        finally:
            if flow.sender.poll() is None:
                # Stopped, not waited for: its JSON lines so far are in the pipe.
                os.killpg(flow.sender.pid, signal.SIGTERM)
            try:
                out, _ = flow.sender.communicate(timeout=10)
            finally:
                flow.stop()
            if puller is not None and store is not None:
                self.stop_puller(puller, store)
            stop(sproc)
        times = [(b.started, b.started + b.seconds) for b in parse(out)]
        # The burst figures are those that started into the pull ("first": the first one it
        # met); the idle capacity counts every burst's time within the pull.
        b = Bursts([z - a for a, z in times if t_start <= a < t_done])
        if rc is None:
            run.notes.append(f"until done {pattern.label}: {name} not done within "
                             f"{t_done - t_start:.0f} s")
        elif rc != 0:
            run.notes.append(f"until done {pattern.label}: {name} exited {rc}:\n"
                             + log.read_text(errors="replace")[-2000:])
        else:
            b.done_after = t_done - t_start
        ref = self.b0.get(pattern.label)
        if ref is not None and ref.seconds:
            # The idle share of the pattern as it runs alone: the pull at best fills that.
            idle_share = pattern.gap / (pattern.gap + ref.p50)
            b.ideal = self.model_bytes * 8 / (self.t0_bps * idle_share)
        s = Samples.read(slog)
        idle = idle_between(times, t_start, t_done)
        pulled = s.bytes(s.dist, t_start, t_done) * 8
        b.pull_share = pulled / (self.t0_bps * idle) if idle > 0 else None
        if cpu is not None and t_done > t_start:
            b.cpu = cpu / (t_done - t_start)
        run.load.append(Path("/proc/loadavg").read_text().split()[0])
        run.bursts[pattern.label] = b

    def stop_puller(self, puller: subprocess.Popen, store: Path) -> None:
        stop(puller)
        shutil.rmtree(store, ignore_errors=True)
        if self.policy is not None:
            # A pull killed before it could clear its caps must not cap the next puller.
            self.node.run([self.wagent, "shaping", "clear", "--policy",  # type: ignore
                           str(self.policy)], check=False)

    def reference(self) -> tuple[Flow, float]:
        sproc, _ = start_sampler(self.node)
        try:
            f, _, _ = self.flow(UNLISTED)
        finally:
            stop(sproc)
        return f, float(Path("/proc/loadavg").read_text().split()[0])

    def bursts_alone(self, pattern: Pattern) -> Bursts:
        sproc, _ = start_sampler(self.node)
        try:
            return self.bursts(pattern)
        finally:
            stop(sproc)


def exited(log: Path) -> int | None:
    """The exit code a once-puller's shell wrote (``EXITED rc``) at the end of ``log``."""
    with open(log, "rb") as fh:
        fh.seek(max(0, fh.seek(0, os.SEEK_END) - 256))
        tail = fh.read().decode(errors="replace").splitlines()
    for line in reversed(tail):
        if line.startswith("EXITED "):
            return int(line.split()[1])
    return None


def start_sampler(node: object) -> tuple[subprocess.Popen, Path]:
    proc = node.popen([sys.executable, str(Path(__file__).resolve()), "--sampler"],  # type: ignore
                      log="yield-sampler")
    return proc, Path(proc.log_path)


def stop(proc: subprocess.Popen) -> None:
    """Ends ``proc``'s whole process group: a puller's shell loop goes at once, the wagent it
    runs a moment later (it cleans up on SIGTERM, and would recreate a store removed before)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# --- the table ---------------------------------------------------------------------------------
@dataclass
class Results:
    seconds: float
    count: int
    cc: str
    queue: str
    scenarios: list[str]
    patterns: list[Pattern]
    until_done: bool
    model_bytes: int
    t0: Flow
    t0_runs: tuple[float, ...]
    b0: dict[str, Bursts]                 # bursts alone, by Pattern.label
    runs: dict[str, PullerRun]
    recovery_s: float = 0.0

    def flow_cells(self, f: Flow | None) -> str:
        if f is None:
            return "-"
        return (f"{100 * f.mean / self.t0.mean:.1f}% / {100 * f.after1 / self.t0.after1:.1f}% / "
                f"{100 * f.first / self.t0.first:.1f}%")

    def burst_cells(self, b: Bursts | None, ref: Bursts) -> str:
        if b is None:
            return "-"
        if not b.seconds or not ref.seconds:
            return "no burst"
        p50 = ref.p50
        # Each over alone's p50 (the strict reading); then the p99 over alone's own p99, as
        # issue 23's table set each figure beside the pull against the same figure alone.
        cells = (f"{b.first / p50:.2f}x / {b.p50 / p50:.3f}x / {b.p99() / p50:.3f}x "
                 f"(all: {b.p99(after_first=False) / p50:.2f}x; p99 vs alone's p99 "
                 f"{b.p99() / ref.p99():.3f}x)")
        share = "-" if b.pull_share is None else f"{100 * b.pull_share:.1f}%"
        cpu = "-" if b.cpu is None else f"{100 * b.cpu:.0f}%"
        return f"{cells}; idle used {share}; CPU {cpu}"

    @staticmethod
    def done_cells(b: Bursts | None) -> str:
        if b is None:
            return "-"
        done = "not done" if b.done_after is None else f"{b.done_after:.1f} s"
        ideal = "-" if b.ideal is None else f"{b.ideal:.1f} s"
        ratio = ("" if b.done_after is None or not b.ideal
                 else f" ({b.done_after / b.ideal:.2f}x)")
        return f"{done} / {ideal}{ratio}"

    def rows(self) -> list[tuple[str, str, list[str]]]:
        r = [self.runs[p] for p in PULLERS]

        def back(run: PullerRun) -> str:
            vals = [f.back_after for f in (run.listed, run.unlisted) if f is not None]
            if not vals:
                return "-"
            if any(v is None for v in vals):
                return f"not within {self.recovery_s:g} s"
            return " / ".join(f"{v:.1f} s" for v in vals)

        rows = []
        if "listed" in self.scenarios:
            rows.append((f"sustained flow, listed port 29500, {self.seconds:g} s: over the run / "
                         "after 1 s / first second, vs alone", "≥98% / ≥99.5% / ≥90%",
                         [self.flow_cells(x.listed) for x in r]))
        if "unlisted" in self.scenarios:
            rows.append((f"sustained flow, unlisted port {UNLISTED}, {self.seconds:g} s: same",
                         "≥98% / ≥99.5% / ≥90%", [self.flow_cells(x.unlisted) for x in r]))
        if "bursts" in self.scenarios:
            many = "until the pull is done" if self.until_done else f"{self.count} bursts"
            for p in self.patterns:
                rows.append((f"bursts of {p.size / 1e6:g} MB every {p.gap:g} s, unlisted port, "
                             f"{many}: first / p50 / p99 after the first, vs alone's p50; the "
                             "pull's goodput / idle capacity between bursts; the puller's CPU, "
                             "of one core", "≤1.5x / ≤1.02x / ≤1.05x; moonshot ≥50%",
                             [self.burst_cells(x.bursts.get(p.label), self.b0[p.label])
                              for x in r]))
                if self.until_done:
                    rows.append((f"training all the time ({p.label}), a "
                                 f"{self.model_bytes / 1e9:.2f} GB model: the pull done in / "
                                 "ideal, the model over the idle capacity (ratio)", "ratio → 1x",
                                 [self.done_cells(x.bursts.get(p.label)) for x in r]))
        if any(x.alone for x in r):
            rows.append(("pull alone, share of the link (mean of the warm-ups)", "≥90%",
                         [f"{100 * statistics.mean(x.alone) / LINK:.1f}%" if x.alone else "-"
                          for x in r]))
        if "listed" in self.scenarios or "unlisted" in self.scenarios:
            rows.append((f"after training stops: back to {100 * BACK_SHARE:.0f}% of the link "
                         "(listed / unlisted run)", "≤5 s", [back(x) for x in r]))
        return rows

    def print(self) -> None:
        from agent.units import format_rate

        print(f"\nYield on a {format_rate(LINK)} bottleneck upstream of the node, queue: "
              f"{QUEUES[self.queue][1]} ({self.queue}), senders' congestion control: {self.cc}; "
              f"wagent with the shipped defaults\n")
        print("| scenario | target | wagent | aria2c -j8 beside | wagent, backoff off |")
        print("|---|---|---|---|---|")
        for name, target, cells in self.rows():
            print(f"| {name} | {target} | " + " | ".join(cells) + " |")
        print(f"\nalone: flow {format_rate(self.t0.mean)} (runs: "
              f"{', '.join(format_rate(x) for x in self.t0_runs)}), first second "
              f"{format_rate(self.t0.first)}")
        for label, b0 in self.b0.items():
            if b0.seconds:
                print(f"alone: bursts {label} first {1000 * b0.first:.0f} ms, p50 "
                      f"{1000 * b0.p50:.0f} ms, p99 {1000 * b0.p99(False):.0f} ms")
        for p in PULLERS:
            run = self.runs[p]
            pulls = ", ".join(format_rate(f.pull) for f in (run.listed, run.unlisted)
                              if f is not None and f.pull is not None)
            print(f"{p}: pull during the sustained flows {pulls or '-'}; load average after "
                  f"each scenario {', '.join(run.load)}")
            for f, what in ((run.listed, "listed"), (run.unlisted, "unlisted")):
                if f is not None:
                    print(f"  {what} flow per second (Mbit/s): "
                          + " ".join(f"{r / 1e6:.0f}" for r in f.intervals))
            for label, b in run.bursts.items():
                print(f"  bursts {label} (ms; *: a pull's first): " + " ".join(
                    f"{1000 * s:.0f}{'*' if i in b.firsts else ''}"
                    for i, s in enumerate(b.seconds)))
            for n in run.notes:
                print(f"  note: {n}")
        print("  T0 per second (Mbit/s): " + " ".join(f"{r / 1e6:.0f}" for r in self.t0.intervals))
        for label, b0 in self.b0.items():
            print(f"  bursts {label} alone (ms): "
                  + " ".join(f"{1000 * s:.0f}" for s in b0.seconds))

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "bursts": self.count, "cc": self.cc,
                "queue": self.queue, "leaf": QUEUES[self.queue][0],
                "scenarios": self.scenarios, "until_done": self.until_done,
                "model_bytes": self.model_bytes,
                "patterns": [{"label": p.label, "size": p.size, "gap": p.gap}
                             for p in self.patterns],
                "t0": asdict(self.t0), "t0_runs": self.t0_runs,
                "bursts_alone": {k: asdict(v) for k, v in self.b0.items()},
                "runs": {p: asdict(r) for p, r in self.runs.items()},
                "table": [{"scenario": n, "target": t, "cells": dict(zip(PULLERS, c,
                                                                           strict=True))}
                          for n, t, c in self.rows()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 s flows, 12 bursts, 2.5 GB")
    ap.add_argument("--seconds", type=float, help="sustained flow length (default 20)")
    ap.add_argument("--bursts", type=int, help="bursts per run (default 30)")
    ap.add_argument("--model-size", help="e.g. 4GB (default 4GB, quick 2.5GB)")
    ap.add_argument("--cc", help="the senders' TCP congestion control (default: the machine's)")
    ap.add_argument("--only", choices=PULLERS, action="append",
                    help="run only these pullers (repeatable)")
    ap.add_argument("--scenarios", choices=SCENARIOS, nargs="+", action="extend",
                    help="run only these scenarios (default: all)")
    ap.add_argument("--pattern", type=parse_pattern, action="append", metavar="SIZE@GAP",
                    help="bursts of SIZE, each followed by GAP s idle (repeatable; default "
                         "24MB@0.5)")
    ap.add_argument("--queue", choices=QUEUES, default="shallow",
                    help="the bottleneck's queue: shallow, a 50 ms bfifo (default); deep, a "
                         "pfifo of 1000 packets")
    ap.add_argument("--until-done", action="store_true",
                    help=f"bursts until the pull is done (at most {UNTIL_DONE_CAP:g} s): its "
                         "time vs the model over the idle capacity")
    ap.add_argument("--link", default="1gbit",
                    help="the bottleneck's rate, also the policy's link_rate (default 1gbit)")
    ap.add_argument("--sampler", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    if args.sampler:
        sampler(SAMPLE_EVERY)
        return 0
    from agent.units import parse_rate, parse_size

    global LINK, LINK_TEXT
    LINK, LINK_TEXT = parse_rate(args.link), args.link
    scenarios = [s for s in SCENARIOS if s in (args.scenarios or SCENARIOS)]
    if args.until_done and "bursts" not in scenarios:
        ap.error("--until-done is for the bursts scenario")
    seconds = args.seconds or (8.0 if args.quick else 20.0)
    count = args.bursts or (12 if args.quick else 30)
    size = parse_size(args.model_size or ("2.5GB" if args.quick else "4GB"))
    patterns = list(dict.fromkeys(args.pattern or [Pattern(BURST_SIZE, BURST_GAP)]))
    return run(seconds, count, size, args.cc, args.only or list(PULLERS), args.json,
               scenarios=scenarios, patterns=patterns, queue=args.queue,
               until_done=args.until_done)


def run(seconds: float, count: int, size: int, cc: str | None, pullers: list[str],
        json_out: str | None, scenarios: list[str], patterns: list[Pattern], queue: str,
        until_done: bool) -> int:
    from tests.modelgen import generate_sized
    from tests.testbed import WAGENT, Testbed

    shm = Path(tempfile.mkdtemp(prefix="wagent-yield-", dir="/dev/shm"))
    try:
        vdir = shm / "origin" / MODEL / VERSION
        t = time.monotonic()
        generate_sized(vdir, size, shards=16)
        subprocess.run([WAGENT, "manifest", "build", str(vdir)], check=True,
                       capture_output=True)
        (vdir.parent / "latest").write_text(VERSION + "\n")
        files = sorted(p for p in vdir.iterdir() if p.is_file())
        total = sum(p.stat().st_size for p in files)
        print(f"model: {len(files)} files, {total / 1e9:.2f} GB, generated in "
              f"{time.monotonic() - t:.0f}s", file=sys.stderr)
        flows = [s for s in scenarios if s != "bursts"]
        with Testbed(tmp_parent=shm) as tb:
            bench = Bench(tb, shm, files, seconds, count, warmup=6.0, recovery=7.0,
                          leaf=QUEUES[queue][0])
            bench.setup(cc)
            cc_name = cc or bench.origin.run(["sysctl", "-n",
                                              "net.ipv4.tcp_congestion_control"]).stdout.strip()
            # The flow alone is the link's capacity for the bursts' idle share too: always run.
            first, _ = bench.reference()
            bench.t0_bps = first.mean
            if "bursts" in scenarios:
                for p in patterns:
                    bench.b0[p.label] = bench.bursts_alone(p)
            runs: dict[str, PullerRun] = {}
            for name in PULLERS:
                runs[name] = PullerRun()
                if name not in pullers:
                    continue
                for what in scenarios:
                    for p in (patterns if what == "bursts" else [None]):
                        print(f"{name}: {what}" + (f" {p.label}" if p else ""), file=sys.stderr)
                        if p is not None and until_done:
                            bench.until_done(name, runs[name], p)
                        else:
                            bench.scenario(name, runs[name], what, p)
            refs = [first]
            if flows:
                # The flow rows compare with the flow alone before and after the pullers.
                refs.append(bench.reference()[0])
            t0 = Flow(statistics.mean(f.mean for f in refs),
                      statistics.mean(f.first for f in refs),
                      statistics.mean(f.after1 for f in refs),
                      [r for f in refs for r in f.intervals])
        res = Results(seconds, count, cc_name, queue, scenarios, patterns, until_done, total,
                      t0, tuple(f.mean for f in refs), bench.b0, runs,
                      recovery_s=bench.recovery - 0.5)
        res.print()
        if json_out:
            Path(json_out).write_text(json.dumps(res.as_dict(), indent=2) + "\n")
        return 0
    finally:
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
