"""The peers bench's cluster run by an existing engine, libtorrent (issue 27's ``torrent`` row):

```
  cache (libtorrent seed) ─┐
  n01 .. nNN (libtorrent)  ─┘ switch   every host capped at ``link`` both ways by the testbed
```

No wagent runs here, so nothing shapes a host's upload but the testbed: every host (the cache
too) is attached with ``rate=link`` (its egress, host -> switch) and ``rate_back=link`` (its
switch port, switch -> host), the same HTB bottleneck with a bfifo leaf both ways. (In the
``tree`` and ``peers`` rows the upload is capped by wagent's own egress tree instead, whose
default class sends a node's ACKs ahead of its uploads; here they share the one queue.)

The cache is pre-seeded: the version is written straight into its directory and is not timed
(its one copy from the origin is the row's origin copies, 1.000 by construction). One torrent
covers the version's files (libtorrent's default: hybrid v1 + v2, SHA-1 and SHA-256 Merkle
trees, pad files so each file starts on a piece), pieces of ``piece_size``: 1 MiB, the bench's
``pulls.piece_size``, or 0 for libtorrent's own choice (64 KiB for 24-32 MiB: some 500 pieces).

Each host runs this file as a client (``python tests/torrent_bed.py client CONFIG``) through the
testbed's process API, so the testbed kills it whatever happens: a libtorrent session on the
host's address and ``PORT``, TCP only (uTP off), no DHT, LSD, UPnP, NAT-PMP, no rate limits
(tc caps), choking at libtorrent's defaults unless ``tuned`` (see ``TUNED``). It adds the torrent
(the cache's in seed mode), writes its status file (JSON) once ready, waits for the ``go`` file,
then connects to the cache and to every node listed before it (one TCP connection per pair, a
full mesh) and keeps seeding after it finished. The status file, rewritten every 0.2 s and at
once on finishing: ``ready``, ``go_at``, ``first_byte_at`` (within 50 ms) and ``finished_at``
(libtorrent's torrent_finished_alert; time.time()), ``downloaded`` and ``uploaded`` (payload
bytes), ``redundant`` and ``failed`` bytes, ``cpu`` (the process's CPU seconds), ``cpu_at_go``.

This module imports nothing but the standard library at the top: the clients import libtorrent
only, the bench nothing of libtorrent (``client_python()`` finds a python that has it).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.testbed import Host, Testbed

PORT = 6881
THIS = Path(__file__).resolve()
MISSING = "python3-libtorrent is not installed (apt install python3-libtorrent)"

# The variant ``torrent-tuned``: every interested peer unchoked (libtorrent's default is the
# fixed_slots_choker, unchoke_slots_limit 8, re-chosen every 15 s, optimistic every 30 s; the seed's
# round_robin). Also understood here, not a setting: ``"super_seeding": True`` (the seed's
# torrent flag; at 4 nodes it brought the cache's copies from 2.0 to 1.14 but the last node
# from 2.2 to 3.0 S/B).
TUNED: dict[str, Any] = {"unchoke_slots_limit": -1}


def client_python() -> str | None:
    """A python that imports libtorrent: this one, else Debian's (the package's); None if
    neither does."""
    for py in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        try:
            ok = subprocess.run([py, "-c", "import libtorrent"], capture_output=True,
                                timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return py
    return None


@dataclass(frozen=True)
class TorrentSpec:
    nodes: int = 8
    link: str = "40mbit"              # every node's and the cache's, both ways
    piece_size: int = 1 << 20         # the torrent's; 0: libtorrent's choice (64 KiB at 32 MiB)
    tuned: bool = False               # TUNED's choking settings, else libtorrent's defaults
    trace: bool = False               # each client logs its peers every second


@dataclass
class TorrentHost:
    id: str
    host: Host
    ip: str
    dir: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def status_path(self) -> Path:
        return self.dir / "status.json"


@dataclass
class Seeded:
    """The version as the cache holds it."""

    version: str
    size: int                          # distinct bytes of its files (as the bench's S)
    manifest: dict[str, Any] = field(repr=False)
    torrent: Path
    piece_size: int
    pieces: int


class TorrentCluster:
    """A cache and ``spec.nodes`` nodes on one switch, each running a libtorrent client."""

    def __init__(self, tb: Testbed, spec: TorrentSpec = TorrentSpec(),
                 python: str | None = None) -> None:
        self.tb, self.spec = tb, spec
        self.python = python or client_python()
        if self.python is None:
            raise RuntimeError(MISSING)
        sw = tb.switch("sw")
        self.cache = self._add(sw, "cache")
        self.nodes = [self._add(sw, f"n{i:02d}") for i in range(1, spec.nodes + 1)]
        self.hosts = [self.cache, *self.nodes]
        self.go_path = tb.tmpdir("torrent") / "go"

    def _add(self, sw: Any, name: str) -> TorrentHost:
        host = self.tb.host(name)
        ep = self.tb.attach(host, sw, rate=self.spec.link, rate_back=self.spec.link)
        return TorrentHost(name, host, ep.ip4, self.tb.tmpdir(f"node-{name}"))

    # -- the version --------------------------------------------------------------------------
    def seed(self, version: str, build: Any) -> Seeded:
        """Write the version into the cache's directory (``build(dir)``), its wagent manifest
        (the sha256 the nodes' files are held to), and one torrent of its files."""
        from tests.testbed import WAGENT

        vdir = self.cache.dir / version
        build(vdir)
        subprocess.run([WAGENT, "manifest", "build", "-q", "--piece-size", "1MiB", str(vdir)],
                       check=True, timeout=120)
        manifest = json.loads((vdir / "manifest.json").read_text())
        size = sum({f["sha256"]: f["size"] for f in manifest["files"]}.values())
        torrent = self.cache.dir / f"{version}.torrent"
        out = self.cache.host.run([self.python, THIS, "make", vdir, torrent,
                                   str(self.spec.piece_size)], timeout=600)
        info = json.loads(out.stdout)
        return Seeded(version, size, manifest, torrent, info["piece_size"], info["pieces"])

    # -- the clients --------------------------------------------------------------------------
    def start(self, s: Seeded, timeout: float = 60) -> None:
        """Every client, the torrent added; returns once each is ready (files checked,
        listening), none connected yet."""
        for i, h in enumerate(self.hosts):
            seed = h is self.cache
            peers = [] if seed else [(x.ip, PORT) for x in self.hosts[:i]]
            conf = {
                "seed": seed, "torrent": str(s.torrent),
                "save_path": str(self.cache.dir if seed else h.dir),
                "listen": f"{h.ip}:{PORT}", "peers": peers, "status": str(h.status_path),
                "go": str(self.go_path), "settings": TUNED if self.spec.tuned else {},
                "trace": self.spec.trace,
            }
            cpath = h.dir / "client.json"
            cpath.write_text(json.dumps(conf))
            h.proc = h.host.popen([self.python, THIS, "client", cpath], log=f"torrent-{h.id}")
        deadline = time.monotonic() + timeout
        for h in self.hosts:
            while not (self.status(h) or {}).get("ready"):
                if h.proc is not None and h.proc.poll() is not None:
                    raise AssertionError(f"{h.id}'s client exited {h.proc.returncode}\n"
                                         f"{self.tb.logs(3000)}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{h.id}'s client never ready\n{self.tb.logs(3000)}")
                time.sleep(0.05)

    def go(self) -> float:
        """Release every client at once (they poll the file every 5 ms); the time released."""
        t0 = time.time()
        self.go_path.write_text(f"{t0}\n")
        return t0

    def status(self, h: TorrentHost) -> dict[str, Any] | None:
        try:
            return json.loads(h.status_path.read_text())
        except (OSError, ValueError):
            return None

    def wait_done(self, timeout: float,
                  hosts: list[TorrentHost] | None = None) -> dict[str, dict[str, Any]]:
        """Every host's status once it reports ``finished_at``."""
        hosts = hosts or self.nodes
        done: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while True:
            for h in hosts:
                doc = self.status(h) or {}
                if h.id not in done and doc.get("finished_at"):
                    done[h.id] = doc
            if len(done) == len(hosts):
                return done
            if time.monotonic() > deadline:
                missing = {h.id: self.status(h) for h in hosts if h.id not in done}
                raise AssertionError(f"not done after {timeout:.0f} s: {missing}\n"
                                     f"{self.tb.logs(3000)}")
            time.sleep(0.1)

    def kill(self, h: TorrentHost) -> None:
        if h.proc is not None and h.proc.poll() is None:
            os.killpg(h.proc.pid, signal.SIGKILL)
            h.proc.wait(10)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each live client used so far, as DaemonHosts reads it."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for h in self.hosts:
            if h.proc is not None and h.proc.poll() is None:
                try:
                    stat = Path(f"/proc/{h.proc.pid}/stat").read_text()
                except OSError:
                    continue
                fields = stat.rsplit(")", 1)[1].split()
                out[h.id] = (int(fields[11]) + int(fields[12])) / tick
        return out

    def wrong_files(self, s: Seeded, hosts: list[TorrentHost]) -> int:
        """Files of the manifest missing or with another sha256, over ``hosts``."""
        wrong = 0
        for h in hosts:
            for f in s.manifest["files"]:
                path = h.dir / s.version / f["path"]
                try:
                    digest = hashlib.sha256(path.read_bytes()).hexdigest()
                except OSError:
                    digest = ""
                wrong += digest != f["sha256"]
        return wrong


# -- inside a host: the client and the torrent maker ------------------------------------------
def make_torrent(vdir: Path, out: Path, piece_size: int) -> dict[str, int]:
    """One torrent of the files under ``vdir`` (its manifest.json left out), hybrid v1 + v2."""
    import libtorrent as lt

    fs = lt.file_storage()
    lt.add_files(fs, str(vdir), lambda p: Path(p).name != "manifest.json")
    t = lt.create_torrent(fs, piece_size)
    t.set_creator("wagent tests/torrent_bed.py")
    lt.set_piece_hashes(t, str(vdir.parent))
    out.write_bytes(lt.bencode(t.generate()))
    return {"piece_size": t.piece_length(), "pieces": t.num_pieces()}


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def client(conf: dict[str, Any]) -> None:
    import libtorrent as lt

    settings: dict[str, Any] = {
        "listen_interfaces": conf["listen"],
        "enable_outgoing_utp": False, "enable_incoming_utp": False,
        "enable_dht": False, "enable_lsd": False, "enable_upnp": False, "enable_natpmp": False,
        "upload_rate_limit": 0, "download_rate_limit": 0,
        "alert_mask": lt.alert_category.status | lt.alert_category.error,
    }
    flags = dict(conf["settings"])
    super_seeding = flags.pop("super_seeding", False)
    for k, v in flags.items():
        if k == "choking_algorithm":
            v = int(lt.choking_algorithm_t.names[v])
        elif k == "seed_choking_algorithm":
            v = int(lt.seed_choking_algorithm_t.names[v])
        settings[k] = v
    ses = lt.session(settings)
    atp = lt.add_torrent_params()
    atp.ti = lt.torrent_info(conf["torrent"])
    atp.save_path = conf["save_path"]
    if conf["seed"]:
        atp.flags |= lt.torrent_flags.seed_mode
        if super_seeding:
            atp.flags |= lt.torrent_flags.super_seeding
    h = ses.add_torrent(atp)
    status_path, go = Path(conf["status"]), Path(conf["go"])
    checking = (lt.torrent_status.checking_files, lt.torrent_status.checking_resume_data)
    while h.status().state in checking or not ses.is_listening():
        time.sleep(0.01)
    doc: dict[str, Any] = {"ready": True, "seed": conf["seed"], "go_at": None,
                           "finished_at": None, "downloaded": 0, "uploaded": 0,
                           "cpu": time.process_time(), "cpu_at_go": None}
    _write(status_path, doc)
    while not go.exists():
        time.sleep(0.005)
    doc["go_at"], doc["cpu_at_go"] = time.time(), time.process_time()
    for ip, port in conf["peers"]:
        h.connect_peer((ip, port))
    next_write = next_trace = 0.0
    while True:
        ses.wait_for_alert(50)
        finished = False
        for a in ses.pop_alerts():
            if isinstance(a, lt.torrent_finished_alert) and not conf["seed"] \
                    and doc["finished_at"] is None:
                doc["finished_at"] = time.time()
                finished = True
        now = time.monotonic()
        if doc.get("first_byte_at") is None and not conf["seed"]:
            if h.status().total_payload_download:
                doc["first_byte_at"] = time.time()
        if finished or now >= next_write:
            st = h.status()
            doc.update(done=st.total_wanted_done, wanted=st.total_wanted,
                       downloaded=st.total_payload_download, uploaded=st.total_payload_upload,
                       failed=st.total_failed_bytes, redundant=st.total_redundant_bytes,
                       peers=st.num_peers, cpu=time.process_time())
            _write(status_path, doc)
            next_write = now + 0.2
            if conf.get("trace") and now >= next_trace:
                next_trace = now + 1.0
                _trace(lt, h, doc)


def _trace(lt: Any, h: Any, doc: dict[str, Any]) -> None:
    """One line per peer to the client's log: rates, choking, queues."""
    t = time.time() - doc["go_at"]
    # c: we choke it, i: we want its pieces, C: it chokes us, I: it wants ours.
    bits = (("c", lt.peer_info.choked), ("i", lt.peer_info.interesting),
            ("C", lt.peer_info.remote_choked), ("I", lt.peer_info.remote_interested))
    for p in h.get_peer_info():
        state = "".join(c for c, bit in bits if p.flags & bit)
        print(f"{t:6.1f} {p.ip[0]:>12s} {state:4s} down {p.down_speed >> 10:5d} KiB/s up "
              f"{p.up_speed >> 10:5d} KiB/s dq {p.download_queue_length:3d} "
              f"uq {p.upload_queue_length:3d} pieces {p.num_pieces}", flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["make"] and len(argv) == 4:
        print(json.dumps(make_torrent(Path(argv[1]), Path(argv[2]), int(argv[3]))))
        return 0
    if argv[:1] == ["client"] and len(argv) == 2:
        client(json.loads(Path(argv[1]).read_text()))
        return 0
    print("usage: torrent_bed.py make VDIR OUT PIECE_SIZE | client CONFIG", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
