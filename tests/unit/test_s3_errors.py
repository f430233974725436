"""An S3 error answer in words: the code decides, the server's message (which may quote what it
was sent) is never shown."""

import pytest

from agent.s3.errors import code_of, explain


def doc(code: str, message: str = "secret AKIA... StringToSign ...") -> bytes:
    return (f'<?xml version="1.0"?><Error><Code>{code}</Code><Message>{message}</Message>'
            f"</Error>").encode()


@pytest.mark.parametrize("status, code, words", [
    (404, "NoSuchBucket", "no such bucket (NoSuchBucket)"),
    (404, "NoSuchKey", "no such key (NoSuchKey)"),
    (403, "AccessDenied", "access denied (AccessDenied)"),
    (403, "SignatureDoesNotMatch", "bad signature (SignatureDoesNotMatch)"),
    (403, "RequestTimeTooSkewed", "clock is more than 15 minutes off"),
    (400, "ExpiredToken", "the credentials expired (ExpiredToken)"),
    (503, "SlowDown", "throttled (SlowDown)"),
    (400, "SomethingNew", "HTTP 400 SomethingNew"),
])
def test_codes_in_words_never_the_servers_message(status, code, words):
    f = explain(status, doc(code), {}, "s3://b/k")
    assert f.words.startswith("s3://b/k: ") and words in f.words, f.words
    assert "AKIA" not in f.words and "StringToSign" not in f.words
    assert f.code == code


def test_throttling_waits_retry_after_wins():
    assert explain(503, doc("SlowDown"), {}, "w").retry_after == 1.0
    assert explain(503, doc("SlowDown"), {}, "w", 7.0).retry_after == 7.0
    assert explain(403, doc("AccessDenied"), {}, "w").retry_after is None


def test_not_an_s3_endpoint():
    f = explain(404, b"<html>Not Found</html>", {}, "s3://b/k")
    assert "without an S3 error document" in f.words and f.code is None
    assert "without an S3 error document" in explain(404, b"", {}, "w").words
    assert explain(404, b"", {}, "w", head=True).words == "w: HTTP 404 (no such key)"
    assert explain(502, b"bad gateway", {}, "w").retry_after == 1.0


def test_code_is_read_with_a_bounded_pattern():
    assert code_of(b"<Error><Code>" + b"A" * 100 + b"</Code></Error>") is None
    assert code_of(b'<!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]><Error>'
                   b"<Code>&e;</Code></Error>") is None
    assert code_of(b"no document") is None
