"""URLs in messages, logs and status lose their credentials and signed-URL secrets."""

import pytest

from agent.redact import redact


@pytest.mark.parametrize("url, shown", [
    ("http://user:s3cr3t@origin:8080/m/v1", "http://origin:8080/m/v1"),
    # an "@" in the password: everything up to the last "@" of the authority goes
    ("http://user:p@s3cr3t@origin/m/latest", "http://origin/m/latest"),
    ("https://user:pa/ss@origin/m", "https://origin/m"),
    ("http://user:s3cr3t@[fd00::1]:8080/m/v1", "http://[fd00::1]:8080/m/v1"),
    ("http://[fd00::1]:8080/m/v1", "http://[fd00::1]:8080/m/v1"),
    ("http://token@origin/m", "http://origin/m"),
    ("https://b.s3.amazonaws.com/m/v1/manifest.json?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=ab12"
     "&X-Amz-Expires=60",
     "https://b.s3.amazonaws.com/m/v1/manifest.json?X-Amz-Credential=***&X-Amz-Signature=***"
     "&X-Amz-Expires=60"),
    ("http://origin/m?token=s3cr3t#part", "http://origin/m?token=***#part"),
    ("http://origin/m?a=1&access_token=s3cr3t&sig=s3cr3t", "http://origin/m?a=1&access_token=***"
     "&sig=***"),
    ("http://origin/m/v1/a%40b.bin?q=a@b", "http://origin/m/v1/a%40b.bin?q=a@b"),
    ("not a url", "not a url"),
])
def test_redact(url, shown):
    assert redact(url) == shown
    assert "s3cr3t" not in redact(url)


def test_policy_errors_show_source_urls_redacted(tmp_path):
    from agent.policy import PolicyError, load_policy
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nsources:\n  - url: ftp://user:s3cr3t@origin/x\n"
                    "  - url: https://user:s3cr3t@origin/m?token=s3cr3t\n")
    with pytest.raises(PolicyError) as e:
        load_policy(str(path))
    assert "'ftp://origin/x' must be an http" in str(e.value)
    assert "'https://origin/m?token=***' must be a base URL" in str(e.value)
    assert "s3cr3t" not in str(e.value)
