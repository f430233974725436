"""A network-namespace testbed: hosts, veth links with HTB bottlenecks, bridges, nginx, iperf3.

```python
from tests.testbed import Testbed, WAGENT
with Testbed() as tb:                       # or the pytest fixture `testbed`
    origin, node = tb.host("origin"), tb.host("node")     # namespaces <prefix>-origin, ...
    link = tb.connect(origin, node, rate="100mbit", rate_back=None)  # HTB on origin -> node
    link.a.ip4, link.a.ip6, link.b.ifname  # Endpoint(host, ifname, ip4, ip6); a = origin side
    sw = tb.switch("sw"); ep = tb.attach(node2, sw, rate=None, rate_back="1gbit")
        # rate: host -> switch, rate_back: switch -> host (the port's download cap)
    tb.shape(host, ifname, "300mbit")       # the same HTB bottleneck on any interface
    srv = tb.nginx(origin, root=path, port=8080, limit_rate="25m")  # nginx units or "200mbit"
    srv.url_for(link.a) / srv.url_for("fd77::1"); srv.requests(); srv.bytes_sent("/m/")
    node.run([WAGENT, "status"], check=False, timeout=60)   # CompletedProcess, text
    p = node.popen([...], env={...})        # own process group, log in p.log_path, killed on exit
    tb.iperf3_server(origin, port=29500)
    res = tb.iperf3(node, server=link.a.ip4, port=29500, seconds=5, reverse=True)
    flow = tb.iperf3_start(...); ...; res = flow.result()     # a flow in the background
    bps = tb.goodput(node, url, seconds=5, streams=1)         # curl, bits/s
    b = tb.bursts(origin, node, server=link.a.ip4, port=40123, size=24 * 10**6, gap=0.5,
                  count=30)                   # on/off bursts, acked; b.result() -> [Burst, ...]
    r = tb.rsyncd(origin, root=path, port=873); r.url_for(link.a) + "/m/"  # a peer tool
    d = tb.tmpdir("store")
    host.add_route(dst, via); host.sysctl(**{"net.ipv4.tcp_congestion_control": "cubic"})
```
Needs root. Everything it makes is removed on exit, on Ctrl-C, SIGTERM, and by the next run's
sweeper if a run was killed outright. Set WAGENT_TESTBED_TMP to put temp dirs elsewhere.
"""

from tests.testbed.bed import Switch, Testbed
from tests.testbed.hosts import REPO, WAGENT, WAGENT_CMD, CommandFailed, Endpoint, Host, Link
from tests.testbed.nginx import Nginx
from tests.testbed.traffic import IperfFlow, IperfResult

__all__ = ["REPO", "WAGENT", "WAGENT_CMD", "CommandFailed", "Endpoint", "Host", "IperfFlow",
           "IperfResult", "Link", "Nginx", "Switch", "Testbed"]
