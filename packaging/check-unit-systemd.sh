#!/bin/sh
# The hardened unit under a real systemd: `packaging/check-unit-systemd.sh [DEB]` (root).
#
# systemd-analyze only reads the unit; this boots systemd as PID 1 in a throwaway container
# (systemd-nspawn over a tmpfs overlay of this machine's root: nothing it writes reaches the
# host; its own network namespace) and runs the package there as the fleet would:
#   - no policy: the unit is skipped by its condition, not failed;
#   - a policy: Type=notify start, the sandbox (user wagent, CAP_NET_ADMIN only, seccomp, ...),
#     shaping on a veth, a pull from nginx, status over the control socket, backoff on a
#     training flow, the watchdog, `systemctl reload` (good and refused), a broken policy
#     failing ExecStartPre;
#   - an upgrade restarts the daemon and the caps stay (one tree, adopted); removal clears them;
#     purge removes the state and keeps /etc/wagent/policy.yaml and the user.
# Needs systemd-container (systemd-nspawn), nginx, iperf3; works with or without systemd on the
# host (nspawn runs with --register=no --keep-unit). check-deb.sh runs it when systemd-nspawn is
# installed, unless WAGENT_CHECK_SYSTEMD=0.
set -eu

PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH LC_ALL=C.UTF-8
unset PYTHONPATH VIRTUAL_ENV 2>/dev/null || true

root=$(cd "$(dirname "$0")/.." && pwd)
deb=${1:-}
if [ -z "$deb" ]; then
    for f in "$root"/build/deb/wagent_*_all.deb; do [ -f "$f" ] && deb=$f; done
fi
die() { echo "check-unit-systemd: FAIL: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root"
if [ -z "$deb" ] || [ ! -f "$deb" ]; then
    die "no .deb given and none in build/deb/; run 'make deb' first"
fi
for tool in systemd-nspawn nginx iperf3; do
    command -v "$tool" >/dev/null || die "needs $tool (apt-get install systemd-container nginx-light iperf3)"
done

work=$(mktemp -d /tmp/wagent-nspawn.XXXXXX)
merged="$work/merged"
nspawn_pid=""
had_nspawn_dir=no
[ -d /run/systemd/nspawn ] && had_nspawn_dir=yes
cleanup() {
    if [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2>/dev/null; then
        leader=$(ps -o pid= --ppid "$nspawn_pid" | head -n 1 | tr -d ' ')
        [ -z "$leader" ] || nsenter -t "$leader" -a systemctl poweroff >/dev/null 2>&1 || true
        i=0
        while kill -0 "$nspawn_pid" 2>/dev/null && [ $i -lt 20 ]; do sleep 0.5; i=$((i + 1)); done
        kill "$nspawn_pid" 2>/dev/null || true
        sleep 1
    fi
    mountpoint -q "$merged" && umount "$merged"
    mountpoint -q "$work" && umount "$work"
    rm -rf "$work"
    [ "$had_nspawn_dir" = yes ] || rm -rf /run/systemd/nspawn
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The container's root: this machine's root file system, read-only below a tmpfs.
mount -t tmpfs -o size=2g tmpfs "$work"
mkdir "$work/upper" "$work/work" "$merged"
mount -t overlay overlay -o "lowerdir=/,upperdir=$work/upper,workdir=$work/work" "$merged"
[ -x "$merged/lib/systemd/systemd" ] || die "no /lib/systemd/systemd in this root (apt-get install systemd)"

# Inside: no policy-rc.d (images for CI often forbid service starts with one), the package
# installed, a default target that starts nothing but the basics.
rm -f "$merged/usr/sbin/policy-rc.d"
cp "$deb" "$merged/root/wagent.deb"
chroot "$merged" dpkg --purge wagent >/dev/null 2>&1 || true
rm -rf "$merged/etc/wagent" "$merged/var/lib/wagent" "$merged/var/cache/wagent"
chroot "$merged" dpkg -i /root/wagent.deb >"$work/install.log" 2>&1 || {
    cat "$work/install.log"; die "dpkg -i in the container root failed"
}
cat >"$merged/etc/systemd/system/wagent-check.target" <<'EOF'
[Unit]
Description=wagent's systemd check: the basics, nothing else
Requires=basic.target
After=basic.target
AllowIsolate=yes
EOF
cat >"$merged/root/inside.sh" <<'INSIDE'
#!/bin/sh
# Runs inside the container, as root, with systemd as PID 1.
set -u
failed=0
ok() { echo "  ok: $*"; }
bad() { echo "  FAIL: $*"; failed=1; }
prop() { systemctl show wagent -p "$1" --value; }
caps() { tc qdisc show | grep -c -E 'qdisc (htb|ingress)'; }
wait_for() {  # seconds, then a command
    n=$1; shift
    while [ "$n" -gt 0 ]; do "$@" >/dev/null 2>&1 && return 0; sleep 1; n=$((n - 1)); done
    return 1
}
status_field() {
    wagent status --json | python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"
}

echo "- no policy: skipped by ConditionPathExists, not failed"
rm -f /etc/wagent/policy.yaml
systemctl start wagent
[ "$(prop ActiveState)" = inactive ] && [ "$(prop ConditionResult)" = no ] &&
    ok "inactive, condition not met" || bad "state $(prop ActiveState), condition $(prop ConditionResult)"

echo "- a link, an origin and a model"
ip netns add origin
ip link add wchk0 type veth peer name wchk1 netns origin
ip addr add 10.9.0.2/24 dev wchk0 && ip link set wchk0 up
ip -n origin addr add 10.9.0.1/24 dev wchk1 && ip -n origin link set wchk1 up
ip -n origin link set lo up
mkdir -p /srv/origin /srv/ngx
(cd "$REPO" && PYTHONPATH="$REPO" python3 -c \
    "from tests.modelgen import generate; generate('/srv/origin/tiny/v1', layers=4, hidden=64, shards=2, seed=5)")
wagent manifest build -q /srv/origin/tiny/v1 || bad "wagent manifest build"
echo v1 >/srv/origin/tiny/latest
cat >/srv/ngx/nginx.conf <<'NG'
worker_processes 1;
user root;
pid /srv/ngx/nginx.pid;
error_log /srv/ngx/error.log warn;
events { worker_connections 64; }
http { access_log off; default_type application/octet-stream; sendfile on;
       server { listen 10.9.0.1:8080; root /srv/origin; } }
NG
ip netns exec origin nginx -c /srv/ngx/nginx.conf
ip netns exec origin iperf3 -s -p 29500 -D
before=$(tc qdisc show; ip -o link show | sed 's/^[0-9]*: //; s/[:@].*//')
cat >/etc/wagent/policy.yaml <<'POLICY'
version: 1
default_role: inference
cache_role: null
waves: {order: [inference], gap: 1s, spread: 1s, cache_lead: 0s}
sources:
  - url: http://10.9.0.1:8080
models:
  - name: tiny
    version: latest
poll_interval: 5s
shaping:
  enabled: true
  interfaces: [wchk0]
  link_rate: 1gbit
  rate: 10mbit
  ceil: 200mbit
POLICY
cp /etc/wagent/policy.yaml /root/good-policy.yaml

echo "- start: Type=notify, the sandbox, shaping, a pull, status"
systemctl start wagent || bad "systemctl start wagent failed"
started=$(date +%s)
[ "$(prop ActiveState)" = active ] && ok "active (running) after READY=1" || bad "state $(prop ActiveState)"
[ -n "$(prop StatusText)" ] && ok "STATUS=$(prop StatusText)" || bad "no STATUS= from the daemon"
pid=$(prop MainPID)
grep -E '^(Uid|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' "/proc/$pid/status" | tr '\t' ' ' |
    sed 's/^/    /'
[ "$(awk '/^CapEff/ {print $2}' "/proc/$pid/status")" = 0000000000001000 ] &&
    [ "$(awk '/^CapBnd/ {print $2}' "/proc/$pid/status")" = 0000000000001000 ] &&
    [ "$(awk '/^Uid/ {print $2}' "/proc/$pid/status")" = "$(id -u wagent)" ] &&
    ok "user wagent, CAP_NET_ADMIN only" || bad "the daemon's identity or capabilities"
[ "$(caps)" -ge 2 ] && ok "ingress qdisc and HTB tree in the kernel" || bad "no shaping in the kernel"
wait_for 30 sh -c "wagent status --json | grep -q '\"state\": *\"done\"'" &&
    ok "pulled tiny v1 into /var/cache/wagent" || bad "the pull didn't finish: $(wagent status)"
wagent status >/dev/null && ok "wagent status: exit 0 (healthy)" || bad "wagent status exit $?"
systemd-analyze security wagent.service | tail -n 1 | sed 's/^/    /'

echo "- a training flow on port 29500: backoff"
iperf3 -c 10.9.0.1 -p 29500 -t 5 -R >/dev/null 2>&1 &
wait_for 5 sh -c "wagent status --json | grep -q '\"state\": *\"backed_off\"'" &&
    ok "backed off while the training flow ran" || bad "no backoff: $(wagent status | grep backoff)"
wait

echo "- reload"
systemctl reload wagent && ok "systemctl reload: accepted" || bad "systemctl reload failed"
sed -i 's/ceil: 200mbit/ceil: 200mbitz/' /etc/wagent/policy.yaml
if systemctl reload wagent 2>/dev/null; then bad "a broken policy was accepted"; else
    [ "$(prop ActiveState)" = active ] && ok "broken policy refused, still running" ||
        bad "state $(prop ActiveState) after a refused reload"
fi

echo "- the watchdog (WatchdogSec=$(prop WatchdogUSec))"
restarts=$(prop NRestarts)
left=$((started + 35 - $(date +%s)))
[ "$left" -le 0 ] || sleep "$left"
[ "$(prop NRestarts)" = "$restarts" ] && [ "$(prop ActiveState)" = active ] &&
    ok "35 s without a watchdog restart" || bad "restarted: NRestarts $(prop NRestarts)"

echo "- restart with the broken policy: ExecStartPre fails; fixed, it comes back by itself"
systemctl restart wagent 2>/dev/null && bad "started with a broken policy"
journalctl -u wagent -n 20 --no-pager | grep -q 'policy.yaml:[0-9]*: shaping.ceil' &&
    ok "file:line message in the journal" || bad "no file:line message in the journal"
[ "$(caps)" -ge 2 ] && ok "caps stayed in place meanwhile" || bad "caps gone while stopped"
cp /root/good-policy.yaml /etc/wagent/policy.yaml
wait_for 25 sh -c '[ "$(systemctl show wagent -p ActiveState --value)" = active ]' &&
    ok "active again by Restart= (no start limit)" || bad "not restarted: $(prop ActiveState)"

echo "- upgrade: restarted, caps kept and adopted"
old=$(prop MainPID)
trees=$(caps)
dpkg -i /root/wagent.deb >/dev/null 2>&1 || bad "dpkg -i (upgrade)"
wait_for 10 sh -c '[ "$(systemctl show wagent -p ActiveState --value)" = active ]'
[ "$(prop MainPID)" != "$old" ] && ok "restarted (pid $old -> $(prop MainPID))" ||
    bad "not restarted by the upgrade"
[ "$(caps)" = "$trees" ] && [ "$(ip -o link show | grep -c ': wg-')" = 1 ] &&
    ok "one tree, adopted" || bad "trees: $(caps), IFBs: $(ip -o link show | grep -c ': wg-')"

echo "- remove: stopped, shaping cleared; purge: state gone, policy and user kept"
apt-get remove -y -q wagent >/dev/null 2>&1 || bad "apt-get remove"
after=$(tc qdisc show; ip -o link show | sed 's/^[0-9]*: //; s/[:@].*//')
[ "$before" = "$after" ] && ok "tc state as before the first start" || bad "tc state differs: $after"
apt-get purge -y -q wagent >/dev/null 2>&1 || bad "apt-get purge"
for d in /var/lib/wagent /var/cache/wagent /run/wagent /usr/share/wagent; do
    [ -e "$d" ] && bad "$d left after purge"
done
[ -e /etc/wagent/policy.yaml ] && getent passwd wagent >/dev/null &&
    ok "purged; /etc/wagent/policy.yaml and the wagent user kept" || bad "policy or user gone"
exit $failed
INSIDE

echo "booting systemd in a container (overlay of /, private network)"
# The source tree is bound at a fixed path: a checkout under /tmp would be hidden by the
# container's own /tmp.
systemd-nspawn -q -D "$merged" --private-network --register=no --keep-unit --link-journal=no \
    --bind-ro="$root:/opt/wagent-src" --console=pipe --boot -- --unit=wagent-check.target >"$work/boot.log" 2>&1 </dev/null &
nspawn_pid=$!
leader=""
i=0
while [ $i -lt 60 ]; do
    leader=$(ps -o pid= --ppid "$nspawn_pid" | head -n 1 | tr -d ' ')
    if [ -n "$leader" ]; then
        state=$(nsenter -t "$leader" -a systemctl is-system-running 2>/dev/null || true)
        case "$state" in running|degraded) break ;; esac
    fi
    kill -0 "$nspawn_pid" 2>/dev/null || { cat "$work/boot.log"; die "systemd-nspawn exited"; }
    sleep 1; i=$((i + 1))
done
[ $i -lt 60 ] || { cat "$work/boot.log"; die "the container's systemd didn't finish booting"; }
echo "systemd in the container: $state"

rc=0
nsenter -t "$leader" -a env REPO=/opt/wagent-src sh /root/inside.sh || rc=$?
[ "$rc" = 0 ] || die "the unit misbehaved under systemd (FAIL lines above)"
echo "check-unit-systemd: the unit works under systemd"
