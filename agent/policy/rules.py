"""The rules that tie several policy keys together (roles and waves, sources, models, rates,
the tc plan); the walk from YAML to dataclasses (``agent.policy.build``) checks each key alone.
Each problem goes to the Builder with its line, so one ``policy check`` lists them all."""

from __future__ import annotations

import difflib
import re
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from agent import units
from agent.cron import CronError, parse_cron
from agent.manifest import ManifestError, check_name
from agent.policy.build import Builder
from agent.policy.model import SCHEMA_VERSION, Policy
from agent.redact import redact
from agent.s3.address import S3AddressError, check_endpoint, is_s3, split_s3
from shaping.errors import PlanError
from shaping.plan import build_plan

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]+)*$")


def check(p: Policy, b: Builder) -> None:
    """The rules that tie keys together; each problem goes to ``b`` with its line."""
    if p.version != SCHEMA_VERSION:
        b.error(b.line_of("version"), f"policy schema version {p.version} is unknown; this "
                                      f"wagent reads version {SCHEMA_VERSION}")
    _check_timezone(p, b)
    _check_roles(p, b)
    _check_sources(p, b)
    _check_models(p, b)
    _check_rates(p, b)
    _check_shaping_plan(p, b)
    if p.metrics.listen is not None:
        host, sep, port = p.metrics.listen.rpartition(":")
        if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
            b.error(b.line_of("metrics.listen"), f"metrics.listen {p.metrics.listen!r} must be "
                                                 f"host:port, e.g. 127.0.0.1:9464 (or null)")


def _check_timezone(p: Policy, b: Builder) -> None:
    if p.timezone == "UTC":
        return
    try:
        ZoneInfo(p.timezone)
    except (ZoneInfoNotFoundError, ValueError):
        b.error(b.line_of("timezone"), f"timezone {p.timezone!r} is not a time zone this host "
                "knows; use an IANA name such as Europe/Berlin or America/New_York (or UTC)")


def _check_roles(p: Policy, b: Builder) -> None:
    names = [r.name for r in p.roles]
    explicit = "waves.order" in b.lines
    # A role whose settings were refused still exists: don't call it unknown as well.
    refused = {path.split(".")[1] for path in b.bad if path.startswith("roles.")}
    known = set(names) | refused | {p.default_role}
    seen: set[str] = set()
    typos = False
    for i, wave in enumerate(p.waves.order):
        line = b.line_of(f"waves.order[{i}]")
        if wave == p.cache_role:
            b.error(line, f"waves.order names the cache role {wave!r}, which pulls ahead of "
                          f"every wave; remove it from waves.order")
        elif wave in seen:
            b.error(line, f"waves.order names {wave!r} twice")
        elif explicit and wave not in known:
            close = _close(wave, sorted(known))
            typos = True
            b.error(line, f"waves.order names unknown role {wave!r}{close}; define it under "
                          f"roles or fix the name")
        seen.add(wave)
    if explicit and not typos:            # a misspelt wave explains the role left out
        for r in p.roles:
            if r.name != p.cache_role and r.name not in p.waves.order:
                b.error(b.line_of(f"roles.{r.name}"), f"role {r.name!r} is in no wave; add it "
                                                      f"to waves.order")
    if (explicit and not typos and p.default_role not in p.waves.order
            and p.default_role != p.cache_role):
        b.error(b.line_of("default_role", b.line_of("waves.order")),
                f"default_role {p.default_role!r} is in no wave; add it to waves.order or "
                f"name another role{_close(p.default_role, list(p.waves.order))}")
    for r in p.roles:
        for j, w in enumerate(r.windows):
            where = f"roles.{r.name}.windows[{j}]"
            try:
                spec = parse_cron(w.cron)
            except CronError as e:
                b.error(b.line_of(f"{where}.cron"), f"{where}.cron: {e}")
                continue
            if w.duration <= 0:
                b.error(b.line_of(f"{where}.duration"), f"{where} is an empty window: duration "
                                                        f"must be more than 0, e.g. 8h")
            elif not spec.fires():
                b.error(b.line_of(f"{where}.cron"), f"{where} is an empty window: cron "
                                                    f"{w.cron!r} never fires")
        for j, pattern in enumerate(r.hosts):
            if not pattern.strip():
                b.error(b.line_of(f"roles.{r.name}.hosts[{j}]"),
                        f"roles.{r.name}.hosts[{j}] is an empty pattern")


def _check_sources(p: Policy, b: Builder) -> None:
    seen: dict[str, int] = {}
    for i, s in enumerate(p.sources):
        where = f"sources[{i}]"
        line = b.line_of(f"{where}.url", b.line_of(where))
        if is_s3(s.url):
            try:
                split_s3(s.url)
                if s.endpoint is not None:
                    check_endpoint(s.endpoint)
            except S3AddressError as e:
                b.error(b.line_of(f"{where}.endpoint", line) if "endpoint" in str(e) else line,
                        f"{where}: {e}")
        else:
            _check_url(b, s.url, f"{where}.url", line)
            for key in ("endpoint", "region", "profile"):
                if getattr(s, key) is not None:
                    b.error(b.line_of(f"{where}.{key}"), f"{where}.{key} is only for s3:// "
                                                         "sources")
            if s.addressing != "auto":
                b.error(b.line_of(f"{where}.addressing"), f"{where}.addressing is only for "
                                                          "s3:// sources")
        if s.proxy is not None:
            _check_url(b, s.proxy, f"{where}.proxy", b.line_of(f"{where}.proxy"))
        url = s.url.rstrip("/")
        if url in seen:
            b.error(b.line_of(where), f"{where}: source {redact(s.url)!r} is listed twice "
                                      f"(first at line {seen[url]})")
        seen.setdefault(url, b.line_of(where))


def _check_url(b: Builder, url: str, where: str, line: int) -> None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        b.error(line, f"{where} {redact(url)!r} is not a URL ({e})")
        return
    if parts.scheme not in ("http", "https") or not parts.hostname:
        b.error(line, f"{where} {redact(url)!r} must be an http:// or https:// URL with a host, "
                      f"e.g. https://weights.example.com/models, or s3://BUCKET/PREFIX")
    elif parts.query or parts.fragment:
        b.error(line, f"{where} {redact(url)!r} must be a base URL without ?query or #fragment")


def _check_models(p: Policy, b: Builder) -> None:
    seen: dict[str, int] = {}
    for i, m in enumerate(p.models):
        where = f"models[{i}]"
        line = b.line_of(f"{where}.name", b.line_of(where))
        if not _NAME.match(m.name) or ".." in m.name.split("/"):
            b.error(line, f"{where}.name {m.name!r} must be letters, digits and . _ + - "
                          f"(with / between parts), no '..'")
        if m.name in seen:
            b.error(line, f"duplicate model {m.name!r} (first at line {seen[m.name]}); list "
                          f"each model once")
        seen.setdefault(m.name, line)
        for what, v in [("version", m.version)] + [(f"pin[{j}]", x) for j, x in enumerate(m.pin)]:
            if what == "version" and v == "latest":
                continue                        # follow the newest, not a version's name
            try:
                check_name("version", v)        # the rule every pull applies (issue 21)
            except ManifestError as e:
                b.error(b.line_of(f"{where}.{what}", line), f"{where}.{what}: {e}")


def _check_rates(p: Policy, b: Builder) -> None:
    sh, bo = p.shaping, p.backoff

    def ok(*paths: str) -> bool:                 # a refused value isn't compared again
        return not b.bad.intersection(paths)

    if sh.rate > sh.ceil and ok("shaping.rate", "shaping.ceil"):
        b.error(b.line_of("shaping.rate", b.line_of("shaping.ceil")),
                f"shaping.rate {units.format_rate(sh.rate)} is above shaping.ceil "
                f"{units.format_rate(sh.ceil)}; the guaranteed rate can't exceed the cap")
    if sh.ceil > sh.link_rate and ok("shaping.ceil", "shaping.link_rate"):
        b.error(b.line_of("shaping.ceil", b.line_of("shaping.link_rate")),
                f"shaping.ceil {units.format_rate(sh.ceil)} is above shaping.link_rate "
                f"{units.format_rate(sh.link_rate)}")
    if sh.enabled and not sh.interfaces:
        b.error(b.line_of("shaping.enabled"), "shaping is enabled but shaping.interfaces is "
                                              "empty; name the interfaces wagent may shape")
    cap = bo.cap if bo.cap is not None else sh.ceil
    if bo.floor > cap and ok("backoff.floor", "backoff.cap", "shaping.ceil"):
        what = "backoff.cap" if bo.cap is not None else "shaping.ceil (backoff.cap is unset)"
        b.error(b.line_of("backoff.floor", b.line_of("backoff.cap")),
                f"backoff.floor {units.format_rate(bo.floor)} is above {what} "
                f"{units.format_rate(cap)}")


def _check_shaping_plan(p: Policy, b: Builder) -> None:
    """Whatever the tc plan itself refuses (interface names, ports, rates the kernel can't
    take) is a policy error too, so `policy check` catches it before a node does."""
    if not p.shaping.enabled or any(k.startswith("shaping.") for k in b.bad) or b.issues:
        return
    try:
        build_plan(p.shaping, p.shaped_sources)
    except PlanError as e:
        key = str(e).split(":", 1)[0] if str(e).startswith("shaping.") else "shaping"
        b.error(b.line_of(key, b.line_of("shaping")), str(e))


def _close(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
