"""The fleet description: its loader (file:line for every problem) and `wagent plan --fleet`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.cli import main
from agent.fleet.topology import TopologyError, load_topology, parse_topology

POLICIES = Path(__file__).resolve().parents[2] / "policies"
EXAMPLE = POLICIES / "topology" / "fleet-topology.example.yaml"


def issues(text: str) -> list[str]:
    with pytest.raises(TopologyError) as e:
        parse_topology(text, "fleet.yaml")
    return [str(i) for i in e.value.issues]


def test_the_example_loads_with_its_shorthands_anchors_and_copies():
    t = load_topology(EXAMPLE)
    names = [name for name, _ in t.expanded()]
    assert names == ["dc1"] + [f"edge-{k}" for k in range(1, 11)]
    dc1 = t.clusters[0]
    assert dc1.link == 100 * 10**9 and dc1.node_link == 25 * 10**9
    groups = {g.role: g for g in dc1.nodes}
    assert groups["inference"].count == 200 and groups["inference"].link is None
    assert groups["training"].count == 800 and dc1.link_of(groups["training"]) == 100 * 10**9
    assert dc1.cache is not None and dc1.cache.nodes == 2
    assert dc1.cache_egress == 50 * 10**9 and dc1.cache_link == dc1.node_link
    edge = t.clusters[1]
    assert edge.node_link == 25 * 10**9          # from the merge key
    assert t.nodes == 200 + 40 + 800 + 2 + 10 * 50
    assert t.efficiency == 0.95 and t.origin.egress == 10 * 10**9


def test_every_problem_has_its_line():
    text = """version: 1
origin: {egres: 1gbit}
clusters:
  a:
    node_link: fast
    nodes: {inference: lots}
    cache: {nodes: 0}
"""
    got = issues(text)
    assert any(i.startswith("fleet.yaml:2: unknown key 'egres' in origin; did you mean "
                            "'egress'?") for i in got), got
    assert any(i.startswith("fleet.yaml:5: clusters.a.node_link: bad rate 'fast'")
               for i in got), got
    assert "fleet.yaml:6: clusters.a.nodes.inference.count expected a whole number, got " \
           "'lots'" in got
    assert any(i.startswith("fleet.yaml:7: clusters.a.cache.nodes is 0") for i in got), got
    # and the rules across keys, once each key is right
    assert issues("""version: 1
origin: {egress: 1gbit}
clusters:
  b:
    count: 2
    node_link: 1gbit
    nodes: {training: 3}
  b-1: {node_link: 1gbit, nodes: {training: 1}}
  "c d": {node_link: 1gbit, nodes: {training: 1}}
""") == ["fleet.yaml:8: clusters.b-1: the name 'b-1' is also made by clusters.b; rename one",
         "fleet.yaml:9: clusters.c d: a cluster name is letters, digits and . _ + - (it names "
         "the nodes the plan hashes)"]


def test_empty_missing_and_broken_files():
    assert issues("") == ["fleet.yaml:1: the fleet description is empty; start it with "
                          "'version: 1'"]
    assert issues("version: 1\nclusters: {a: {node_link: 1gbit, nodes: {x: 1}}}\n") == [
        "fleet.yaml:1: missing key 'origin'"]
    assert issues("version: 1\norigin: {egress: 1gbit}\n") == [
        "fleet.yaml:1: clusters: describe at least one cluster"]
    got = issues("version: 1\norigin: {egress: 1gbit\nclusters: {}\n")
    assert len(got) == 1 and got[0].startswith("fleet.yaml:3: YAML syntax error"), got
    assert issues("version: 2\norigin: {egress: 1gbit}\nclusters: {a: {node_link: 1gbit, "
                  "nodes: {x: 1}}}\n") == ["fleet.yaml:1: version is 2; choose one of 1"]
    assert issues("version: 1\norigin: {egress: 1gbit}\nclusters:\n  a: {node_link: 1gbit}\n"
                  ) == ["fleet.yaml:4: clusters.a: no nodes; give nodes: {ROLE: COUNT, ...}"]


def test_plan_fleet_prints_each_wave_and_the_origin(capsys):
    code = main(["plan", "--policy", str(POLICIES / "fleet.example.yaml"), "--fleet",
                 str(EXAMPLE), "--size", "120GB", "--published", "2026-12-02T12:00:00Z"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("published 2026-12-02 12:00:00 UTC; 112 GiB per node (the whole "
                               "version), 1542 nodes in 11 clusters")
    assert lines[1].split() == ["wave", "role", "nodes", "start", "p50", "done", "p99", "done",
                                "last", "done", "from", "cache", "origin", "sent", "origin",
                                "peak"]
    assert [row.split()[:3] for row in lines[2:6]] == [
        ["cache", "cache", "2"], ["0", "inference", "700"], ["1", "evaluation", "40"],
        ["2", "training", "800"]]
    assert lines[6].startswith("origin: sent ") and "502.00 copies of the version" in lines[6]
    assert "dc1                 1042          2.00" in out


def test_plan_fleet_json_for_scripts(capsys):
    code = main(["plan", "--policy", str(POLICIES / "fleet.example.yaml"), "--fleet",
                 str(EXAMPLE), "--size", "120GB", "--fetch", "3GB", "--json", "--per-node",
                 "--published", "2026-12-02T12:00:00Z"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["plan_version"] == 1 and doc["kind"] == "fleet"
    assert doc["size"] == 120 * 10**9 and doc["fetch"] == 3 * 10**9 and doc["cold"] is False
    assert {"bytes", "copies", "peak_bps", "peak_at"} == set(doc["origin"])
    assert [w["role"] for w in doc["waves"]] == ["cache", "inference", "evaluation", "training"]
    assert set(doc["waves"][0]) == {"role", "wave", "nodes", "first_start", "p50_done",
                                    "p99_done", "last_done", "origin_bytes", "origin_peak_bps",
                                    "from_cache", "never"}
    dc1 = doc["clusters"][0]
    assert dc1["name"] == "dc1" and dc1["copies"] == pytest.approx(2.0)   # two caches
    assert len(doc["nodes"]) == 1542
    assert doc["nodes"][0]["node"] == "dc1-cache-1" and doc["nodes"][0]["source"] == "origin"


def test_plan_fleet_with_peers_says_what_each_cache_sends(tmp_path, capsys):
    policy = tmp_path / "policy.yaml"
    policy.write_text((POLICIES / "fleet.example.yaml").read_text().replace(
        "peers:\n  enabled: false", "peers:\n  enabled: true"))
    args = ["plan", "--policy", str(policy), "--fleet", str(EXAMPLE), "--size", "120GB",
            "--published", "2026-12-02T12:00:00Z"]
    assert main(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("cluster "))
    assert header.split() == ["cluster", "nodes", "origin", "copies", "cache", "copies", "last",
                              "done"]
    # dc1's two caches each send each piece once to their share of the cluster
    assert any(line.startswith("dc1 ") and line.split()[2:4] == ["2.00", "2.00"]
               and line.endswith("(nodes serve each other)") for line in out.splitlines()), out
    assert main([*args, "--json"]) == 0
    dc1 = json.loads(capsys.readouterr().out)["clusters"][0]
    assert dc1["peers"] is True and dc1["cache_copies"] == pytest.approx(2.0)


def test_plan_usage_errors_exit_2_and_bad_files_exit_1(tmp_path, capsys):
    policy = str(POLICIES / "fleet.example.yaml")
    assert main(["plan", "--policy", policy, "--fleet", str(EXAMPLE)]) == 2
    assert "--fleet needs --size" in capsys.readouterr().err
    assert main(["plan", "--policy", policy, "--fleet", str(EXAMPLE), "--size", "1GB",
                 "--fetch", "2GB"]) == 2
    assert "--fetch 2GB is more than --size 1GB" in capsys.readouterr().err
    assert main(["plan", "--policy", policy, "--nodes", "10", "--cold"]) == 2
    assert "go with --fleet" in capsys.readouterr().err
    bad = tmp_path / "fleet.yaml"
    bad.write_text("version: 1\norigin: {egress: 1gbit}\nclusters:\n  a: {node_link: 1gbit, "
                   "nodes: {inference: 1}, cashe: {}}\n")
    assert main(["plan", "--policy", policy, "--fleet", str(bad), "--size", "1GB"]) == 1
    assert f"{bad}:4: unknown key 'cashe' in clusters.a; did you mean 'cache'?" in \
        capsys.readouterr().err
    assert main(["plan", "--policy", policy, "--fleet", str(EXAMPLE), "--size", "1GB",
                 "--roles", "inference=1"]) == 2
    assert "--roles goes with --nodes" in capsys.readouterr().err
    typo = tmp_path / "typo.yaml"
    typo.write_text("version: 1\norigin: {egress: 1gbit}\nclusters:\n  a: {node_link: 1gbit, "
                    "nodes: {infrence: 1}}\n")
    assert main(["plan", "--policy", policy, "--fleet", str(typo), "--size", "1GB"]) == 1
    assert f"{typo}: nodes: unknown role 'infrence' (did you mean 'inference'?)" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as e:        # exactly one of --fleet and --nodes
        main(["plan", "--policy", policy, "--size", "1GB"])
    assert e.value.code == 2
