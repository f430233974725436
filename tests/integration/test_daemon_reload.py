"""Reload is mark-and-sweep on the kernel side too: a changed cap is applied in place (one
tree, adopted, not a second one), and a policy that no longer shapes clears wagent's trees."""

import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.daemon_helpers import Node, node_policy, start, status
from tests.testbed import WAGENT

pytestmark = [pytest.mark.netns, pytest.mark.debian]

ROLES = {"inference": "inf-*", "evaluation": "eval-*", "training": "trn-*"}


def reload(node: Node) -> subprocess.CompletedProcess:
    return subprocess.run([WAGENT, "reload", "--socket", str(node.socket)], capture_output=True,
                          text=True, timeout=60)


def test_reload_moves_the_cap_in_place_then_sweeps_shaping(testbed):
    tb = testbed
    h = tb.host("node")
    peer = tb.host("peer")
    link = tb.connect(peer, h)
    d = tb.tmpdir("node")
    node = Node("node", "inf-1", h, link.b.ifname, d, d / "policy.yaml")
    pol = node_policy(node, ["http://192.0.2.1:8080"], role_hosts=ROLES)
    node.policy.write_text(yaml.safe_dump(pol))
    start(node)
    try:
        deadline = time.monotonic() + 30
        while status(node)[0] not in (0, 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        _, doc = status(node)
        ifb = doc["shaping"]["interfaces"][0]["device"]
        assert "ceil 40Mbit" in h.run(["tc", "class", "show", "dev", ifb]).stdout

        pol["shaping"]["ceil"] = "20mbit"
        node.policy.write_text(yaml.safe_dump(pol))
        r = reload(node)
        assert r.returncode == 0, r.stderr
        code, doc = status(node)
        # running (its source, 192.0.2.1, never answers: polls failing in a row make it degraded)
        assert code in (0, 1) and doc["policy"]["reloads"] == 1
        assert doc["shaping"]["cap_bps"] == 20_000_000
        assert doc["backoff"]["cap_bps"] == 20_000_000
        classes = h.run(["tc", "class", "show", "dev", ifb]).stdout
        assert "ceil 20Mbit" in classes and "ceil 40Mbit" not in classes, classes
        assert h.run(["tc", "qdisc", "show", "dev", ifb]).stdout.count("htb") == 1

        pol["shaping"]["enabled"] = False
        node.policy.write_text(yaml.safe_dump(pol))
        r = reload(node)
        assert r.returncode == 0, r.stderr
        _, doc = status(node)
        assert doc["shaping"]["enabled"] is False
        assert ifb not in h.run(["ip", "link"]).stdout
        assert "htb" not in h.run(["tc", "qdisc", "show", "dev", node.ifname]).stdout
    finally:
        node.proc.send_signal(signal.SIGTERM)
        node.proc.wait(10)
        print(Path(node.proc.log_path).read_text())


def test_a_recreated_interface_gets_its_caps_back(testbed):
    """The interface deleted and created again under the same name (a driver reset, a bond
    rebuilt) comes back unshaped; the daemon's periodic re-apply puts the tree and the ingress
    redirect back, and counts the repair."""
    tb = testbed
    h = tb.host("node")
    peer = tb.host("peer")
    link = tb.connect(peer, h)
    d = tb.tmpdir("node")
    node = Node("node", "inf-1", h, link.b.ifname, d, d / "policy.yaml")
    pol = node_policy(node, ["http://192.0.2.1:8080"], role_hosts=ROLES,
                      serve_ports=[8080])
    node.policy.write_text(yaml.safe_dump(pol))
    start(node)
    try:
        deadline = time.monotonic() + 30
        while status(node)[0] not in (0, 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "htb 5747:" in h.run(["tc", "qdisc", "show", "dev", node.ifname]).stdout
        h.run(["ip", "link", "del", node.ifname], check=True)
        h.run(["ip", "link", "add", node.ifname, "type", "veth", "peer", "name", "rv-peer"],
              check=True)
        h.run(["ip", "link", "set", node.ifname, "up"], check=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            qdiscs = h.run(["tc", "qdisc", "show", "dev", node.ifname]).stdout
            if "htb 5747:" in qdiscs and "ingress ffff:" in qdiscs:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"caps not back on the re-created link: {qdiscs}")
        filters = h.run(["tc", "filter", "show", "dev", node.ifname, "ingress"]).stdout
        assert "mirred" in filters and f"wg-{node.ifname}"[:15] in filters, filters
        _, doc = status(node)
        assert doc["daemon"]["error_counts"]["shaping_repairs"] >= 1
    finally:
        node.proc.send_signal(signal.SIGTERM)
        node.proc.wait(10)
        print(Path(node.proc.log_path).read_text()[-3000:])


def test_a_reload_moving_the_socket_into_an_unsafe_directory_is_refused(testbed, tmp_path):
    """Checked before anything changes: the old socket keeps answering, the old policy stays."""
    import os
    tb = testbed
    h = tb.host("node")
    peer = tb.host("peer")
    link = tb.connect(peer, h)
    d = tb.tmpdir("node")
    node = Node("node", "inf-1", h, link.b.ifname, d, d / "policy.yaml")
    pol = node_policy(node, ["http://192.0.2.1:8080"], role_hosts=ROLES)
    node.policy.write_text(yaml.safe_dump(pol))
    start(node)
    try:
        deadline = time.monotonic() + 30
        while status(node)[0] not in (0, 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        unsafe = tmp_path / "anyone-writes"
        unsafe.mkdir()
        os.chmod(unsafe, 0o777)
        pol["control"]["socket"] = str(unsafe / "control.sock")
        node.policy.write_text(yaml.safe_dump(pol))
        r = reload(node)
        assert r.returncode != 0 and str(unsafe) in r.stdout + r.stderr, r
        code, doc = status(node)
        assert code == 1 and str(unsafe) in doc["policy"]["last_error"]
        assert not (unsafe / "control.sock").exists()
    finally:
        node.proc.send_signal(signal.SIGTERM)
        node.proc.wait(10)
        print(Path(node.proc.log_path).read_text()[-3000:])
