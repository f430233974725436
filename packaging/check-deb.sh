#!/bin/sh
# The package's acceptance, as CI runs it (as root, on a Debian 12 machine it may install onto):
#   packaging/check-deb.sh [path/to/wagent_VERSION_all.deb]     (default: build/deb/wagent_*_all.deb)
#
#  1. lintian --fail-on warning (overrides in packaging/deb/wagent.lintian-overrides, each justified)
#  2. apt-get install ./wagent_*.deb: every dependency resolves from Debian's archive
#  3. systemd-analyze verify prints nothing for the unit; systemd-analyze security --offline=yes
#     rates it 2.5 or less (the "Overall exposure level" line: --threshold is broken in systemd 252)
#  4. with Debian's python3 and packaged libraries only: wagent --version, wagent policy check on the
#     shipped policies, and tests/package/test_installed.py (the wagent user with CAP_NET_ADMIN only,
#     on the testbed: apply shaping, pull a model, answer status)
#  5. in a network namespace where the installed wagent has shaped a link: an upgrade (dpkg -i of
#     the same .deb) leaves the caps alone; apt-get purge clears the tc state there, and leaves no
#     files but those Debian's policy keeps
#     (the wagent system user; /etc/wagent/policy.yaml, config management's file)
#  6. the unit under a real systemd, booted in a throwaway container: packaging/check-unit-systemd.sh
#     (when systemd-nspawn is installed; WAGENT_CHECK_SYSTEMD=0 skips it)
#
# A subcommand that still answers "not implemented yet" makes its step say SKIP, not fail; the
# step turns on by itself once the subcommand lands.
set -eu

PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV PYTHONSTARTUP PYTHONUSERBASE 2>/dev/null || true
export LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive
MAX_EXPOSURE=2.5

root=$(cd "$(dirname "$0")/.." && pwd)
deb=${1:-}
if [ -z "$deb" ]; then
    for f in "$root"/build/deb/wagent_*_all.deb; do [ -f "$f" ] && deb=$f; done
fi
unit=/lib/systemd/system/wagent.service
failed=0
ns=""
work=$(mktemp -d "${TMPDIR:-/tmp}/wagent-check-deb.XXXXXX")
cleanup() {
    [ -z "$ns" ] || ip netns delete "$ns" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() { printf '\n== %s\n' "$*"; }
fail() { echo "check-deb: FAIL: $*" >&2; failed=1; }
die() { echo "check-deb: FAIL: $*" >&2; exit 1; }
skip() { echo "check-deb: SKIP: $*"; }
# `wagent --help` lists each subcommand with its help; the stubs say "(not implemented yet)".
pending() { /usr/bin/wagent --help 2>/dev/null | grep -Eq "^ +$1 +\(not implemented yet\)"; }

[ "$(id -u)" = 0 ] || die "run as root: this installs and purges the package"
if [ -z "$deb" ] || [ ! -f "$deb" ]; then
    die "no .deb given and none in build/deb/; run 'make deb' first"
fi
deb=$(cd "$(dirname "$deb")" && pwd)/$(basename "$deb")
version=$(dpkg-deb -f "$deb" Version)
echo "package: $deb (version $version)"

step "lintian --fail-on warning"
# Lintian warns that running as root "is not recommended"; it only reads the .deb here.
lintian_rc=0
lintian --fail-on warning -I "$deb" >"$work/lintian.txt" 2>&1 || lintian_rc=$?
grep -v 'running with root privileges is not recommended' "$work/lintian.txt" || true
if [ "$lintian_rc" != 0 ]; then
    fail "lintian reports warnings or errors (above)"
else
    echo "no warnings or errors: ok"
fi

step "man page renders without warnings (groff -man -ww -z)"
man_out=$(groff -man -ww -z "$(dirname "$0")/deb/wagent.8" 2>&1)
if [ -n "$man_out" ]; then
    echo "$man_out"
    fail "groff warns about wagent.8 (above)"
else
    echo "no warnings: ok"
fi

step "apt-get install $deb"
if dpkg-query -W -f='${Status}' wagent 2>/dev/null | grep -q 'ok installed'; then
    echo "purging the installed wagent first, so this is a fresh install"
    apt-get purge -y -q wagent >/dev/null
fi
# Only Debian's archive: apt resolves the dependencies from the configured sources.
apt-get install -y -q --no-install-recommends "$deb" >"$work/apt.log" 2>&1 || {
    cat "$work/apt.log"
    die "apt-get install failed"
}
getent passwd wagent >/dev/null || die "postinst did not create the wagent system user"
echo "installed; wagent user: $(getent passwd wagent)"

step "systemd-analyze verify $unit"
out=$(systemd-analyze verify "$unit" 2>&1) || true
if [ -n "$out" ]; then
    printf '%s\n' "$out"
    fail "systemd-analyze verify printed the above"
else
    echo "nothing printed: ok"
fi

step "systemd-analyze security --offline=yes (threshold $MAX_EXPOSURE)"
systemd-analyze security --offline=yes "$unit" >"$work/security.txt" 2>&1 || true
exposure=$(sed -n 's/.*Overall exposure level for wagent\.service: \([0-9.]*\).*/\1/p' "$work/security.txt")
if [ -z "$exposure" ]; then
    cat "$work/security.txt"
    fail "no 'Overall exposure level' line in systemd-analyze security's output"
else
    grep '✗' "$work/security.txt" || true
    echo "overall exposure level: $exposure"
    awk -v e="$exposure" -v m="$MAX_EXPOSURE" 'BEGIN { exit !(e <= m) }' ||
        fail "exposure $exposure is above $MAX_EXPOSURE"
fi

# Debian's python3 with the packaged libraries only: the launcher runs `python3 -I`, which ignores
# PYTHONPATH and user site-packages, and env -i drops everything else.
run_wagent() { env -i PATH="$PATH" LC_ALL=C.UTF-8 /usr/bin/wagent "$@"; }

step "wagent --version"
got=$(run_wagent --version 2>&1) || fail "wagent --version exited non-zero: $got"
[ "$got" = "wagent $version" ] || fail "wagent --version printed '$got', want 'wagent $version'"
echo "$got"

step "wagent policy check /usr/share/wagent/policies/*.yaml"
if pending policy; then
    skip "'wagent policy' is not implemented yet"
else
    # shellcheck disable=SC2046 # the glob is the list of policies
    run_wagent policy check $(ls /usr/share/wagent/policies/*.yaml) ||
        fail "the shipped policies don't pass wagent policy check"
fi

step "installed-package integration test (tests/package/test_installed.py, Debian's python3)"
# PYTHONPATH gives pytest the testbed and the model generator from the tree; the wagent under test
# is /usr/bin/wagent, whose -I ignores PYTHONPATH.
(cd "$root" && env -i PATH="$PATH" LC_ALL=C.UTF-8 HOME="$work" CI="${CI:-}" PYTHONPATH="$root" \
    PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -m pytest -p no:cacheprovider -q -rs \
    tests/package/test_installed.py) || fail "tests/package/test_installed.py failed"

step "apt-get purge: removal clears the shaping, purge leaves nothing behind"
dpkg-query -L wagent | sort >"$work/files"
ns="wagent-chk-$$"
ip netns add "$ns"
ip -n "$ns" link set lo up
ip -n "$ns" link add wchk0 type veth peer name wchk1
ip -n "$ns" link set wchk0 up
ip -n "$ns" link set wchk1 up
snapshot() {
    { ip netns exec "$ns" tc qdisc show; ip -n "$ns" -o link show | sed 's/^[0-9]*: //; s/ .*//'; } |
        sort
}
snapshot >"$work/tc.before"
shaped=no
if pending shaping; then
    skip "'wagent shaping' is not implemented yet: purge is checked without shaping in place"
else
    cat >"$work/policy.yaml" <<EOF
version: 1
shaping:
  enabled: true
  interfaces: [wchk0]
  link_rate: 1gbit
  pull_ports: [8080]
  rate: 10mbit
  ceil: 100mbit
EOF
    # As root in the namespace, with the default state directory: the prerm's `wagent shaping
    # clear` must find what this made.
    if ip netns exec "$ns" env -i PATH="$PATH" /usr/bin/wagent shaping apply --policy "$work/policy.yaml"; then
        snapshot >"$work/tc.shaped"
        if cmp -s "$work/tc.before" "$work/tc.shaped"; then
            fail "wagent shaping apply changed nothing in the namespace"
        else
            shaped=yes
        fi
    else
        fail "wagent shaping apply failed in the check namespace"
    fi
fi
# dpkg runs the maintainer scripts in this namespace, so they act on it alone. First an upgrade
# (the same version again: dpkg runs prerm upgrade, postinst configure): the caps must stay.
if [ "$shaped" = yes ]; then
    ip netns exec "$ns" dpkg -i "$deb" >"$work/upgrade.log" 2>&1 || {
        cat "$work/upgrade.log"
        die "reinstalling the package (an upgrade to the same version) failed"
    }
    snapshot >"$work/tc.upgraded"
    if cmp -s "$work/tc.shaped" "$work/tc.upgraded"; then
        echo "an upgrade left the caps in place: ok"
    else
        diff "$work/tc.shaped" "$work/tc.upgraded" || true
        fail "an upgrade changed the tc state (diff above)"
    fi
fi
ip netns exec "$ns" apt-get purge -y -q wagent >"$work/purge.log" 2>&1 || {
    cat "$work/purge.log"
    die "apt-get purge failed"
}
grep -i -E 'wagent:|warning' "$work/purge.log" || true
snapshot >"$work/tc.after"
if ! cmp -s "$work/tc.before" "$work/tc.after"; then
    diff "$work/tc.before" "$work/tc.after" || true
    fail "tc state after purge differs from before shaping (diff above)"
elif [ "$shaped" = yes ]; then
    echo "tc state after purge equals the state before shaping: ok"
fi
left=""
while read -r path; do
    # Directories shared with other packages (/usr, /lib/systemd/system, ...) stay, of course;
    # /etc/wagent stays while config management's policy is in it.
    case "$path" in /.) continue ;; esac
    if [ "$path" = /etc/wagent ] && [ -e /etc/wagent/policy.yaml ]; then continue; fi
    if [ -e "$path" ] && ! dpkg-query -S "$path" >/dev/null 2>&1; then
        left="$left $path"
    fi
done <"$work/files"
for path in /var/lib/wagent /var/cache/wagent /run/wagent /usr/share/wagent /usr/bin/wagent \
    "$unit" /usr/lib/sysusers.d/wagent.conf /etc/systemd/system/multi-user.target.wants/wagent.service; do
    [ -e "$path" ] || [ -L "$path" ] && left="$left $path"
done
if [ -n "$left" ]; then
    fail "left behind after purge:$left"
else
    echo "no files left behind"
fi
# Kept on purge on purpose (see wagent(8), FILES): the system user, and the policy if present.
echo "kept as Debian practice has it: user $(getent passwd wagent | cut -d: -f1,3)" \
    "$( [ -e /etc/wagent/policy.yaml ] && echo '; /etc/wagent/policy.yaml (config management)')"

step "the unit under a real systemd (packaging/check-unit-systemd.sh)"
if [ "${WAGENT_CHECK_SYSTEMD:-1}" = 0 ]; then
    skip "WAGENT_CHECK_SYSTEMD=0"
elif ! command -v systemd-nspawn >/dev/null; then
    skip "needs systemd-nspawn: apt-get install systemd-container"
else
    "$root/packaging/check-unit-systemd.sh" "$deb" || fail "the unit misbehaved under systemd"
fi

if [ "$failed" != 0 ]; then
    echo; echo "check-deb: FAILED (see above)" >&2
    exit 1
fi
echo; echo "check-deb: all checks passed (exposure $exposure)"
