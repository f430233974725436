"""`wagent policy check`: every error class with the line it names; the examples load clean."""

from __future__ import annotations

import dataclasses
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from agent.policy import Issue, PolicyError, check_policy, load_policy, parse_policy
from agent.policy import model as policy_model
from agent.policy.document import policy_document
from agent.policy.model import Policy

POLICIES = Path(__file__).resolve().parents[2] / "policies"

GOOD = """\
version: 1
roles:
  cache:
    hosts: ["cache-*"]
  inference:
    hosts: ["inf-*"]
  training:
    hosts: [gpu-*]
    windows:
      - cron: "0 22 * * mon-fri"
        duration: 8h
waves:
  order: [inference, training]
  gap: 30m
  spread: 20m
sources:
  - url: http://cache:8080
  - url: https://origin.example.com/models
    ca_bundle: /etc/wagent/ca.pem
    credentials: /etc/wagent/token
models:
  - name: llama
    version: "20240601"
    pin: ["20240601"]
  - name: qwen
"""


def check(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(text))
    return [str(i) for i in check_policy(path)]


def one(tmp_path: Path, text: str) -> tuple[int, str]:
    issues = check(tmp_path, text)
    assert len(issues) == 1, issues
    _, line, message = issues[0].split(":", 2)
    return int(line), message.strip()


def test_good_policy_loads_with_values_in_units(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    p = load_policy(path)
    assert p.waves.gap == 1800.0 and p.waves.spread == 1200.0
    assert p.role("training").windows[0].duration == 8 * 3600
    assert [m.version for m in p.models] == ["20240601", "latest"]
    assert p.models[0].pin == ("20240601",)
    assert p.sources[1].credentials == "/etc/wagent/token"
    assert p.path == str(path) and len(p.sha256) == 64


@pytest.mark.parametrize("name", ["fleet.example.yaml", "demo.yaml"])
def test_example_policies_round_trip(name, tmp_path):
    p = load_policy(POLICIES / name)
    assert check_policy(POLICIES / name) == []
    # `policy show` output is itself a policy that loads to the same values
    shown = tmp_path / "shown.yaml"
    shown.write_text(yaml.safe_dump(policy_document(p), sort_keys=False))
    again = load_policy(shown)
    assert dataclasses.replace(again, path="", sha256="") == \
        dataclasses.replace(p, path="", sha256="")


def test_fleet_example_and_schema_document_every_key():
    text = (POLICIES / "fleet.example.yaml").read_text()
    schema = (POLICIES / "schema.md").read_text()
    for cls in (Policy, policy_model.Role, policy_model.Window, policy_model.Waves,
                policy_model.Source, policy_model.Model, policy_model.StoreSettings,
                policy_model.Pulls, policy_model.Shaping, policy_model.Backoff,
                policy_model.MetricsSettings, policy_model.Peers,
                policy_model.Control):
        for f in dataclasses.fields(cls):
            if f.metadata.get("yaml", True) and not f.metadata.get("key"):
                assert f"{f.name}:" in text, f"{cls.__name__}.{f.name} not in the example"
                assert f"`{f.name}`" in schema or f".{f.name}`" in schema, \
                    f"{cls.__name__}.{f.name} not in schema.md"


def test_unknown_key_with_did_you_mean(tmp_path):
    line, msg = one(tmp_path, GOOD + "pulls:\n  straems: 4\n")
    assert line == 27
    assert msg == "unknown key 'straems' in pulls; did you mean 'streams'?"


def test_unknown_top_level_key_lists_known_keys(tmp_path):
    line, msg = one(tmp_path, GOOD + "zzz: 1\n")
    assert line == 26 and "unknown key 'zzz'" in msg and "known keys: version, roles" in msg


def test_bad_unit_names_the_accepted_forms(tmp_path):
    line, msg = one(tmp_path, GOOD + "shaping:\n  ceil: 5 gigabit\n")
    assert line == 27
    assert msg.startswith("shaping.ceil: bad rate '5 gigabit'; accepted:") and "mbit" in msg


def test_bare_number_for_a_size_is_refused(tmp_path):
    line, msg = one(tmp_path, GOOD + "pulls:\n  piece_size: 64\n")
    assert line == 27 and "size 64 needs a unit" in msg and "MiB" in msg


def test_bad_cron(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("0 22 * * mon-fri", "0 25 * * mon-fri"))
    assert line == 10
    assert "hour 25 is out of range 0-23" in msg


def test_bad_weekday_name(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("mon-fri", "mon-fry"))
    assert line == 10 and "day of week 'fry' is not a number (names: sun..sat)" in msg


def test_wave_naming_an_unknown_role(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("[inference, training]", "[inference,\n    trainng]"))
    assert line == 14
    assert "waves.order names unknown role 'trainng' (did you mean 'training'?)" in msg


def test_role_in_no_wave(tmp_path):
    text = GOOD.replace("  training:\n    hosts", "  batch:\n    hosts: [b-*]\n  training:\n"
                                                  "    hosts")
    line, msg = one(tmp_path, text)
    assert line == 7 and "role 'batch' is in no wave; add it to waves.order" in msg


def test_cache_role_in_a_wave(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("[inference, training]", "[cache, inference, training]"))
    assert line == 13 and "cache role 'cache'" in msg


def test_empty_window_duration_zero(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("duration: 8h", "duration: 0s"))
    assert line == 11 and "empty window" in msg


def test_empty_window_cron_never_fires(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("0 22 * * mon-fri", "0 0 30 feb *"))
    assert line == 10 and "empty window: cron '0 0 30 feb *' never fires" in msg


def test_duplicate_models(tmp_path):
    line, msg = one(tmp_path, GOOD + "  - name: llama\n")
    assert line == 26 and msg == "duplicate model 'llama' (first at line 22); list each model once"


def test_source_that_is_not_http(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("http://cache:8080", "ftp://cache"))
    assert line == 17 and "sources[0].url 'ftp://cache' must be an http:// or https:// URL" in msg


def test_proxy_that_is_not_http(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("  - url: http://cache:8080",
                                           "  - url: http://cache:8080\n    proxy: cache:3128"))
    assert line == 18 and "sources[0].proxy" in msg


def test_yaml_syntax_error_with_its_line(tmp_path):
    issues = check(tmp_path, GOOD.replace("  gap: 30m", "  gap: [30m"))
    assert len(issues) == 1
    assert issues[0].startswith(f"{tmp_path / 'p.yaml'}:") and "YAML syntax error" in issues[0]
    assert int(issues[0].split(":")[1]) in (14, 15)


def test_duplicate_key(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("  gap: 30m", "  gap: 30m\n  gap: 40m"))
    assert line == 15 and "duplicate key 'waves.gap' (first at line 14)" in msg


def test_wrong_types(tmp_path):
    text = GOOD + "pulls:\n  streams: many\nshaping:\n  enabled: 3\nwaves2: x\n"
    issues = check(tmp_path, text)
    assert any(":27: pulls.streams expected a whole number, got 'many'" in i for i in issues)
    assert any(":29: shaping.enabled expected true or false, got '3'" in i for i in issues)
    line, msg = one(tmp_path, GOOD.replace("  inference:\n    hosts: [\"inf-*\"]",
                                           "  inference: [inf-*]"))
    assert line == 5 and "roles.inference: expected a mapping of keys, got a list" in msg


def test_floor_above_cap(tmp_path):
    line, msg = one(tmp_path, GOOD + "backoff:\n  floor: 1gbit\n  cap: 500mbit\n")
    assert line == 27 and "backoff.floor 1 Gbit/s is above backoff.cap 500 Mbit/s" in msg


def test_floor_above_shaping_ceil_when_cap_unset(tmp_path):
    line, msg = one(tmp_path, GOOD + "backoff:\n  floor: 1gbit\nshaping:\n  ceil: 500mbit\n")
    assert line == 27 and "shaping.ceil (backoff.cap is unset)" in msg


def test_rates_as_shares_of_the_link(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GOOD + "shaping:\n  link_rate: 25gbit\n  ceil: 40%\nbackoff:\n"
                    "  floor: 0.5%\n  link_threshold: 2%\n  cap: 10gbit\n")
    p = load_policy(path)
    assert p.shaping.ceil == 10 * 10**9
    assert (p.backoff.floor, p.backoff.link_threshold, p.backoff.cap) == \
        (125 * 10**6, 500 * 10**6, 10 * 10**9)


def test_shipped_defaults_are_shares_of_the_link(tmp_path):
    for link, floor in ((10**9, 2 * 10**6), (100 * 10**9, 200 * 10**6)):
        p = Policy(shaping=policy_model.Shaping(interfaces=("eth0",), link_rate=link))
        assert p.shaping.enabled and p.shaping.ceil == link       # naming interfaces turns it on
        assert p.backoff.floor == floor and p.backoff.link_threshold == link // 20
        assert p.backoff.increase == link // 10 and p.backoff.tick <= 0.1


def test_bad_share(tmp_path):
    line, msg = one(tmp_path, GOOD + "backoff:\n  floor: 150%\n")
    assert line == 27 and msg.startswith("backoff.floor: bad share '150%'")


def test_rate_above_ceil(tmp_path):
    line, msg = one(tmp_path, GOOD + "shaping:\n  rate: 600mbit\n  ceil: 400mbit\n")
    assert line == 27 and "shaping.rate 600 Mbit/s is above shaping.ceil 400 Mbit/s" in msg


def test_tick_below_10ms(tmp_path):
    line, msg = one(tmp_path, GOOD + "backoff:\n  tick: 5ms\n")
    assert line == 27 and msg == "backoff.tick is 5ms; it must be at least 10ms"


def test_priority_outside_0_7(tmp_path):
    line, msg = one(tmp_path, GOOD + "shaping:\n  priority: 8\n")
    assert line == 27 and msg == "shaping.priority is 8; it must be between 0 and 7"


def test_unknown_schema_version(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("version: 1", "version: 2", 1))
    assert line == 1 and "schema version 2 is unknown; this wagent reads version 1" in msg


def test_port_ranges(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GOOD + "backoff:\n  training_ports: [29500, \"40000-40100\"]\n")
    assert load_policy(path).backoff.training_ports == ((29500, 29500), (40000, 40100))
    issues = check(tmp_path, GOOD + "backoff:\n  training_ports: [\"40100-40000\", x]\n")
    assert len(issues) == 2 and all(":27: backoff.training_ports" in i for i in issues)


def test_all_errors_are_collected_in_line_order(tmp_path):
    text = GOOD.replace("version: 1", "version: 9", 1).replace("gap: 30m", "gap: 30 mins") + \
        "pulls:\n  straems: 4\nshaping:\n  priority: 9\n"
    issues = check(tmp_path, text)
    lines = [int(i.split(":")[1]) for i in issues]
    assert lines == [1, 14, 27, 29]


def test_policy_error_holds_file_line_message(tmp_path):
    with pytest.raises(PolicyError) as e:
        parse_policy(GOOD + "pulls:\n  straems: 4\n", "fleet.yaml")
    assert e.value.issues == [Issue("fleet.yaml", 27, "unknown key 'straems' in pulls; did you "
                                                      "mean 'streams'?")]
    assert str(e.value).startswith("fleet.yaml:27: unknown key")


def test_empty_and_missing_files(tmp_path):
    assert check(tmp_path, "") == [f"{tmp_path / 'p.yaml'}:1: the policy is empty; start it "
                                   f"with 'version: 1'"]
    assert check_policy(tmp_path / "nope.yaml")[0].line == 0
    assert "No such file" in str(check_policy(tmp_path / "nope.yaml")[0])


def test_default_waves_are_the_conventional_roles_present_then_custom_ones(tmp_path):
    p = parse_policy("version: 1\nroles:\n  batch: {hosts: [b-*]}\n  cache: {}\n"
                     "  inference: {}\n")
    assert p.waves.order == ("inference", "training", "batch")   # training: the default_role
    assert parse_policy("version: 1\n").waves.order == ("inference", "evaluation", "training")


def test_merge_keys_and_anchors():
    p = parse_policy("""\
version: 1
roles:
  inference: &common
    hosts: [inf-*]
    windows: [{cron: "@daily", duration: 1h}]
  training:
    <<: *common
    hosts: [gpu-*]
""")
    assert p.role("training").hosts == ("gpu-*",)
    assert p.role("training").windows == p.role("inference").windows


def test_alias_bomb_and_recursive_alias_are_refused_quickly():
    # Typed walking never expands an alias where the schema doesn't nest, so a "billion
    # laughs" document costs one error per item, and a recursive alias is a type error.
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb = "version: 1\nx-defs:\n" + "\n".join("  " + v for v in levels) + \
        "\nmodels: *l8\n"
    recursive = "version: 1\nroles:\n  inference:\n    hosts: &h [x, *h]\n"
    for doc in (bomb, recursive):
        t0 = time.monotonic()
        with pytest.raises(PolicyError):
            parse_policy(doc)
        assert time.monotonic() - t0 < 1.0



def test_minimal_policy_is_all_defaults():
    p = parse_policy("version: 1\n")
    assert dataclasses.replace(p, path="", sha256="") == Policy()


def test_scalar_where_a_list_is_expected_is_one_item(tmp_path):
    p = parse_policy(GOOD + "shaping:\n  interfaces: eth0\n  serve_ports: 8080\n")
    assert p.shaping.interfaces == ("eth0",) and p.shaping.serve_ports == (8080,)


def test_a_new_field_needs_no_loader_change():
    @dataclasses.dataclass(frozen=True)
    class Extra:
        burst: int = policy_model.size_field(1024, min=512)
        settle: float = policy_model.duration_field(2.0)

    from agent.policy.build import Builder

    b = Builder("x.yaml")
    node = yaml.compose("burst: 64KiB\nsettle: 1m30s\n")
    assert b.build(Extra, node, "extra") == Extra(65536, 90.0)
    b.build(Extra, yaml.compose("burst: 1B\n"), "extra")
    assert b.issues == [("x.yaml", 1, "extra.burst is 1 B; it must be at least 512 B")]


def test_x_keys_are_ignored_and_hold_anchors():
    p = parse_policy("""\
version: 1
x-night: &night {cron: "0 22 * * *", duration: 8h}
roles:
  training:
    windows: [*night]
    x-note: anything
""")
    assert p.role("training").windows[0].duration == 8 * 3600


def test_default_role_in_no_wave(tmp_path):
    line, msg = one(tmp_path, GOOD.replace("roles:", "default_role: trainin\nroles:"))
    assert line == 2
    assert msg == "default_role 'trainin' is in no wave; add it to waves.order or name another " \
                  "role (did you mean 'training'?)"
    p = parse_policy("version: 1\ndefault_role: batch\nroles:\n  inference: {}\n")
    assert p.waves.order == ("inference", "batch")
