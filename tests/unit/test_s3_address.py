"""s3:// sources: where their objects are on HTTP, and what a bad one is told."""

import pytest

from agent.policy.loading import PolicyError, parse_policy
from agent.policy.model import Source
from agent.s3.address import S3AddressError, http_base, object_key, split_s3, virtual_host
from shaping.plan import source_ports


def test_path_style_on_an_endpoint_virtual_host_on_aws():
    assert http_base("s3://models/a/b", "http://minio:9000/", None, "auto") == \
        "http://minio:9000/models/a/b"
    assert http_base("s3://models", None, "eu-west-1", "auto") == \
        "https://models.s3.eu-west-1.amazonaws.com"
    assert http_base("s3://my.models/x", None, None, "auto") == \
        "https://s3.amazonaws.com/my.models/x"          # dots: TLS can't cover the name
    assert http_base("s3://models/x", "https://rgw.local", None, "virtual") == \
        "https://models.rgw.local/x"
    assert not virtual_host("models", None, "path")


def test_prefix_and_keys():
    assert split_s3("s3://models//") == ("models", "")
    assert object_key("s3://models/fleet/", "m/v1/a.bin") == "fleet/m/v1/a.bin"
    assert object_key("s3://models", "m/latest") == "m/latest"
    assert http_base("s3://models/a b", "http://h:1", None, "auto") == "http://h:1/models/a%20b"


@pytest.mark.parametrize("url", ["s3://Models/x", "s3://ab/x", "s3://10.0.0.1/x",
                                 "s3://models/a/../b", "s3://models/x?versionId=1", "http://x"])
def test_bad_urls(url):
    with pytest.raises(S3AddressError):
        split_s3(url)


def test_source_base_feeds_the_ports_shaping_classifies():
    s = Source("s3://models/fleet", endpoint="http://10.1.2.3:8333")
    assert s.is_s3 and s.base == "http://10.1.2.3:8333/models/fleet"
    assert source_ports([s, Source("s3://models", region="us-west-2")]) == (443, 8333)


def policy(source: str) -> str:
    return f"version: 1\nsources:\n  - {source}\nmodels:\n  - name: m\n"


@pytest.mark.parametrize("source, message", [
    ("url: s3://Models/x", "p.yaml:3: sources[0]: 's3://Models/x': 'Models' is not a bucket"),
    ("url: s3://models\n    endpoint: ftp://x", "p.yaml:4: sources[0]: endpoint 'ftp://x'"),
    ("url: s3://models\n    endpoint: http://u:p@minio:9000", "must have no user"),
    ("url: http://o:80\n    region: eu-west-1", "p.yaml:4: sources[0].region is only for "
                                                "s3:// sources"),
    ("url: http://o:80\n    addressing: path", "sources[0].addressing is only for s3://"),
    ("url: s3://models\n    addressing: sideways", "p.yaml:4: sources[0].addressing is "
                                                   "'sideways'; choose one of auto, path, virtual"),
])
def test_bad_s3_sources_are_refused_with_their_line(source, message):
    with pytest.raises(PolicyError) as e:
        parse_policy(policy(source), "p.yaml")
    assert message in str(e.value)


def test_a_good_s3_source():
    p = parse_policy(policy("url: s3://models/fleet\n    endpoint: http://minio:9000\n"
                            "    profile: fleet\n    credentials: /etc/wagent/s3.ini"), "p.yaml")
    s = p.sources[0]
    assert (s.endpoint, s.profile, s.addressing) == ("http://minio:9000", "fleet", "auto")


def test_credentials_files_others_may_read_are_refused_and_rotation_is_seen(tmp_path):
    import os

    from agent.s3.auth import S3AuthError, S3Auths, check_private
    f = tmp_path / "s3.ini"
    f.write_text("[default]\naws_access_key_id = AKIA1\naws_secret_access_key = one\n")
    f.chmod(0o644)
    with pytest.raises(S3AuthError, match=f"credentials file {f}: others may read it"):
        check_private(str(f))
    f.chmod(0o640)
    check_private(str(f))                       # group root: root and the service user only
    if os.geteuid() == 0:
        os.chown(f, -1, 4242)
        with pytest.raises(S3AuthError, match="group 4242 may read it"):
            check_private(str(f))
        os.chown(f, 4242, 0)
        with pytest.raises(S3AuthError, match="owned by uid 4242"):
            check_private(str(f))
        os.chown(f, 0, 0)
    f.chmod(0o600)
    check_private(str(f))
    auths = S3Auths()
    s = Source("s3://models/fleet", endpoint="http://minio:9000", credentials=str(f))
    first = auths.of(s)
    assert auths.of(s) is first and not first.anonymous
    signed = first.sign("GET", s.base + "/m/latest", {})
    assert signed["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIA1/")
    assert "one" not in signed["Authorization"]
    f.write_text("[default]\naws_access_key_id = AKIA2\naws_secret_access_key = two\n")
    f.chmod(0o600)
    assert auths.of(s).sign("GET", s.base + "/m/latest", {})["Authorization"].startswith(
        "AWS4-HMAC-SHA256 Credential=AKIA2/")
    empty = tmp_path / "empty.ini"
    empty.write_text("[other]\n")
    empty.chmod(0o600)
    with pytest.raises(S3AuthError, match=r"no \[default\] section"):
        auths.of(Source("s3://models", credentials=str(empty)))

