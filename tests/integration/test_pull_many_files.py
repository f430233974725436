"""A version of many small files pulled under a low limit of open files (issue 21).

systemd gives a service a soft limit of 1024 descriptors unless the unit says otherwise. A pull
used to open each file's part file and journal up front, two descriptors per file, so a version
of more than about 500 files failed with "Too many open files", and failed again on every try.
Here the limit is 256 (set in the child before it runs the pull: `ulimit -n 256`) and the version
has 1500 files, so a pull that needs a descriptor per file can't pass.
"""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from agent.pull.connections import Connections
from agent.store import Store
from tests.pull_helpers import FaultyServer, LoopbackNginx, publish_dir, same_files

# The deadline watchdog and pull sockets' registry these tests' pulls use (the daemon's come
# from Application, the CLI's from its command).
CONNECTIONS = Connections()

pytestmark = pytest.mark.debian

FILES = 1500
NOFILE = 256
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = tmp_path_factory.mktemp("origin")
    d = root / "many" / "v1"
    for i in range(FILES):
        sub = d / f"shard-{i // 100:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"part-{i:04d}.bin").write_bytes(f"file {i}\n".encode() * (1 + i % 7))
    publish_dir(d, piece_size=4096)
    return root


CHILD = """
import json, sys
from agent.policy.model import Source
from agent.pull.connections import Connections
from agent.pull.engine import PullError, PullOptions, pull_version
from agent.store import Store
url, store, streams = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = PullOptions(streams=streams, retries=0, backoff_base=0.01, read_timeout=5,
                      connect_timeout=2)
try:
    r = pull_version([Source(url)], "many", "v1", Store(store), options=options,
                     connections=Connections())
except PullError as e:
    print(json.dumps({"error": str(e)}))
else:
    print(json.dumps({"fetched": r.bytes_fetched, "total": r.bytes_total, "files": r.files}))
"""


def pull_limited(url: str, store: Path, streams: int = 8) -> dict:
    """One pull of many/v1 in a child whose soft RLIMIT_NOFILE is ``NOFILE`` (`ulimit -n`)."""
    def lower() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, hard))

    r = subprocess.run([sys.executable, "-c", CHILD, url, str(store), str(streams)], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=lower,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def leftovers(store: Store) -> list[str]:
    """What partial/ holds besides the pulls' own lock file."""
    return sorted(p.name for p in store.partial.iterdir() if not p.name.startswith("."))


def test_a_version_of_1500_files_pulls_under_256_open_files(origin, tmp_path):
    store = Store(tmp_path / "store")
    with LoopbackNginx(origin) as ng:
        r = pull_limited(ng.url, store.root)
    assert "error" not in r, r["error"]
    assert r == {"fetched": r["total"], "total": r["total"], "files": FILES}
    same_files(store.version_dir("many", "v1"), origin / "many" / "v1")
    assert leftovers(store) == []


def test_a_failed_pull_under_the_limit_leaves_only_what_the_next_pull_adopts(origin, tmp_path):
    """A source that fails a third of the files: the pull fails for that reason (not for want
    of descriptors), and the next pull, under the same limit, resumes it: it fetches only what
    the first didn't land and leaves nothing behind."""
    store = Store(tmp_path / "store")
    with FaultyServer(origin, "error_500", fault_on=r"part-1[0-4]\d\d\.bin$") as bad:
        failed = pull_limited(bad.url, store.root)
    assert "HTTP 500" in failed.get("error", ""), failed
    left = leftovers(store)
    assert left and all(n.endswith((".part", ".journal")) for n in left)
    with LoopbackNginx(origin) as ng:
        r = pull_limited(ng.url, store.root)
    assert "error" not in r, r["error"]
    assert r["files"] == FILES and 0 < r["fetched"] < r["total"], r
    same_files(store.version_dir("many", "v1"), origin / "many" / "v1")
    assert leftovers(store) == []


def test_a_pull_that_fails_to_start_takes_none_of_the_files_it_made(origin, tmp_path):
    """Another pull owns the version's last file: this one is told so, and the 1499 partial
    files it made before finding out go with it, instead of waiting a week for the cleaner."""
    from agent.blob_id import blob_id
    from agent.manifest import parse
    from agent.policy.model import Source
    from agent.pull.engine import PullError, pull_version
    from agent.store.partial import Claims

    m = parse((origin / "many" / "v1" / "manifest.json").read_bytes())
    store = Store(tmp_path / "store")
    store.ensure()
    with Claims(store.partial) as other, LoopbackNginx(origin) as ng:
        other.take(blob_id(m.files[-1]), "busy")
        with pytest.raises(PullError, match="another pull is already fetching"):
            pull_version([Source(ng.url)], "many", "v1", store, connections=CONNECTIONS)
        assert leftovers(store) == []
