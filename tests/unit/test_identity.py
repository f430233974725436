"""Node identity and role: machine-id else hostname; /etc/wagent/role, host patterns, default."""

from __future__ import annotations

from agent.identity import identify, node_id, role_for
from agent.policy import parse_policy

POLICY = parse_policy("""\
version: 1
roles:
  cache: {hosts: [wcache-*]}
  inference: {hosts: ["inf-*", "serve-??"]}
  training: {hosts: ["gpu-*"]}
default_role: evaluation
waves: {order: [inference, evaluation, training]}
""")


def test_machine_id_else_hostname(tmp_path):
    mid = tmp_path / "machine-id"
    mid.write_text("5f2c0a9e1d3b4c6f8a7b9c0d1e2f3a4b\n")
    assert node_id(mid, "gpu-1") == "5f2c0a9e1d3b4c6f8a7b9c0d1e2f3a4b"
    assert node_id(tmp_path / "missing", "gpu-1") == "gpu-1"
    (tmp_path / "empty").write_text("\n")
    assert node_id(tmp_path / "empty", "gpu-1") == "gpu-1"


def test_role_from_patterns_in_policy_order_case_insensitive(tmp_path):
    none = tmp_path / "role"
    assert role_for(POLICY, "GPU-17", none) == ("training", "hosts 'gpu-*'")
    assert role_for(POLICY, "serve-07", none)[0] == "inference"
    assert role_for(POLICY, "serve-100", none) == ("evaluation", "default")
    assert role_for(POLICY, "wcache-a", none)[0] == "cache"


def test_role_override_file_wins(tmp_path):
    override = tmp_path / "role"
    override.write_text("cache\n")
    assert role_for(POLICY, "gpu-1", override) == ("cache", f"override {override}")
    override.write_text("  \n")                  # empty: ignored
    assert role_for(POLICY, "gpu-1", override)[0] == "training"


def test_identify(tmp_path):
    ident = identify(POLICY, hostname="inf-3", machine_id=tmp_path / "none",
                     override=tmp_path / "none")
    assert (ident.node_id, ident.hostname, ident.role) == ("inf-3", "inf-3", "inference")


def test_override_naming_an_unknown_role_warns(tmp_path):
    override = tmp_path / "role"
    override.write_text("infrence\n")
    ident = identify(POLICY, hostname="gpu-1", machine_id=tmp_path / "none", override=override)
    assert ident.role == "infrence" and "not in the policy" in ident.warning
    assert identify(POLICY, hostname="gpu-1", machine_id=tmp_path / "none",
                    override=tmp_path / "none").warning is None
