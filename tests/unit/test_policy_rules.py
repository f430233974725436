from agent.policy import check_policy


def test_policy_check_reports_what_the_tc_plan_refuses(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("version: 1\nshaping:\n  enabled: true\n"
                 "  interfaces: [averyveryverylonginterfacename0]\n  link_rate: 1gbit\n")
    issues = check_policy(p)
    assert [(i.line, "not an interface name" in i.message) for i in issues] == [(4, True)]
