"""Fixture /proc and /sys trees for the detector tests, written as the kernel lays them out."""

from __future__ import annotations

import shutil
from pathlib import Path

from agent.yielding.ratelimit import TokenBucket
from agent.yielding.sockets import StreamsSample, most_in_flight


def set_netdev(root: Path, ifname: str, rx: int, tx: int, ifindex: int = 2) -> None:
    dev = root / "sys" / "class" / "net" / ifname
    (dev / "statistics").mkdir(parents=True, exist_ok=True)
    (dev / "ifindex").write_text(f"{ifindex}\n")
    (dev / "statistics" / "rx_bytes").write_text(f"{rx}\n")
    (dev / "statistics" / "tx_bytes").write_text(f"{tx}\n")


def remove_netdev(root: Path, ifname: str) -> None:
    shutil.rmtree(root / "sys" / "class" / "net" / ifname)


def set_ib_port(root: Path, dev: str, port: int, rcv_words: int | None = None,
                xmit_words: int | None = None, hw: dict[str, int] | None = None) -> None:
    pdir = root / "sys" / "class" / "infiniband" / dev / "ports" / str(port)
    (pdir / "counters").mkdir(parents=True, exist_ok=True)
    (pdir / "hw_counters").mkdir(parents=True, exist_ok=True)
    if rcv_words is not None:
        (pdir / "counters" / "port_rcv_data").write_text(f"{rcv_words}\n")
    if xmit_words is not None:
        (pdir / "counters" / "port_xmit_data").write_text(f"{xmit_words}\n")
    for name, value in (hw or {}).items():
        (pdir / "hw_counters" / name).write_text(f"{value}\n")


def remove_ib(root: Path, dev: str) -> None:
    shutil.rmtree(root / "sys" / "class" / "infiniband" / dev)


TCP_HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
              "  timeout inode\n")


def tcp_line(n: int, local: str, remote: str, state: int, inode: int = 1000) -> str:
    return (f"{n:4d}: {local} {remote} {state:02X} 00000000:00000000 00:00000000 00000000"
            f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n")


def write_tcp(root: Path, lines4: list[str], lines6: list[str] | None = None) -> None:
    net = root / "proc" / "net"
    net.mkdir(parents=True, exist_ok=True)
    (net / "tcp").write_text(TCP_HEADER + "".join(lines4))
    if lines6 is not None:
        (net / "tcp6").write_text(TCP_HEADER + "".join(lines6))


def add_process(root: Path, pid: int, comm: str, maps: str, readable: bool = True) -> None:
    pdir = root / "proc" / str(pid)
    pdir.mkdir(parents=True, exist_ok=True)
    (pdir / "comm").write_text(comm + "\n")
    if readable:
        (pdir / "maps").write_text(maps)
    else:
        (pdir / "maps").mkdir()  # reading a directory fails like an unreadable file does


# The shipped defaults, as a user writes a policy: the interface, the link's rate, the training
# port. The yield bench, the backoff CPU bench and the netns test all run with exactly this.
SHIPPED_POLICY = """\
version: 1
store:
  path: {store}
shaping:
  interfaces: [{ifname}]
  link_rate: 1gbit
backoff:
  training_ports: [29500]
state_dir: {state}
"""


class Bucket(TokenBucket):
    """A token bucket that records every rate it is given."""

    def __init__(self, bits_per_s=None):
        super().__init__(bits_per_s)
        self.rates = []

    def set_rate(self, bits_per_s):
        self.rates.append(bits_per_s)
        super().set_rate(bits_per_s)


class Windows:
    """A stand-in for agent.yielding.sockets.PullSockets."""

    def __init__(self, received=0):
        self.rates, self.budget_s, self.most, self.received = [], None, None, received
        self.training = []

    def guard(self, training, announced=False):
        self.training.append(training)

    def configure(self, backoff):
        self.budget_s, self.most = backoff.queue_budget, most_in_flight(backoff)

    def expect_cuts(self, bucket):
        self.bucket = bucket

    def set_rate(self, bps):
        self.rates.append(bps)

    def sample(self):
        return StreamsSample(streams=8, min_rtt_us=40, bytes_received=self.received,
                             window=10_000)
