"""The FUSE server of the lazy mount: pyfuse3 answering the kernel, on a mount root made.

The only module that imports pyfuse3 and trio. The daemon never mounts: the root CLI opens
/dev/fuse, mounts it and passes the descriptor over the control socket (``agent.mount.service``);
pyfuse3 is given ``/dev/fd/N`` as its "mount point", which libfuse takes as an already mounted
session, so the daemon keeps its hardening (no CAP_SYS_ADMIN, no /dev/fuse in its namespace).

Why one trio thread and reads in other threads: pyfuse3 runs every handler as a trio task on
one thread. A handler that blocks (a read waiting for its piece to be fetched, a cold pread)
would stall every other reader, even ones whose bytes are here (measured: an ``open`` stalled
3.65 s behind a blocked read). So the handlers only look at the tree (values in memory) and
hand reads to threads (``trio.to_thread``), up to ``READ_THREADS`` at once.

One session per process (pyfuse3 keeps it in module globals; a second ``init`` silently
replaces the first): every version is a directory of this one mount (``agent.mount.tree``).

What the kernel may keep: the content of a version never changes, so entries and attributes
are cached for a day and pages stay cached across opens (``keep_cache``); only the root's
listing (versions come and go) is cached for a second.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

import pyfuse3
import trio

from agent.mount.reader import Reader, ReadFailed
from agent.mount.tree import ROOT, Node, Tree

log = logging.getLogger(__name__)

READ_THREADS = 64           # reads served at once (most wait for a piece; the rest are preads)
MAX_TASKS = 256             # requests in flight on the trio loop (pyfuse3's workers)
IMMUTABLE_TTL = 86400.0     # seconds the kernel keeps a version's entries and attributes
ROOT_TTL = 1.0              # ...and the root's (versions come and go)
BLOCK = 4096

# Taking over a mount whose server died (a restart): the kernel sent INIT once, to the first
# server, and libfuse answers EIO to every request until it has seen one. So libfuse is given a
# socket holding a made-up INIT (fuse_in_header + fuse_init_in, protocol 7.38) and, once it has
# read it, the real /dev/fuse descriptor is put under the same number (``_Operations.init``);
# its INIT reply then goes to the kernel with a ``unique`` nobody waits for and is dropped.
# Then FUSE_NOTIFY_RESEND (Linux >= 6.9) has the kernel queue again the requests the dead
# server had read and never answered: their readers get their bytes instead of hanging.
FUSE_INIT = 26
FUSE_NOTIFY_RESEND = 7
_INIT_FLAGS = (1 << 0) | (1 << 13) | (1 << 14) | (1 << 22)   # ASYNC_READ, READDIRPLUS(+AUTO),
#                                                             MAX_PAGES: what the kernel offers


def fake_init() -> bytes:
    body = struct.pack("<IIII", 7, 38, 128 * 1024, _INIT_FLAGS) + bytes(48)
    header = struct.pack("<IIQQIIIHH", 40 + len(body), FUSE_INIT, (1 << 62) + 2, 0, 0, 0, 0, 0,
                         0)
    return header + body


class FuseServer:
    """Serves ``tree`` on the mounted FUSE descriptor ``fd`` (a duplicate is given to pyfuse3,
    which closes it). ``lock`` guards the tree (the daemon's control calls change it);
    ``on_error`` hears every read that failed (status, the journal)."""

    def __init__(self, fd: int, tree: Tree, lock: threading.Lock, reader: Reader,
                 on_error: Callable[[str], None], *, taking_over: bool = False) -> None:
        """``taking_over``: the mount had a server before (this daemon's previous process);
        see ``fake_init``."""
        self.tree = tree
        self.lock = lock
        self.reader = reader
        self.on_error = on_error
        self._fd = os.dup(fd)
        self._swap: tuple[int, int] | None = None     # (placeholder number, the real device)
        self._init_peer: socket.socket | None = None
        if taking_over:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            b.send(fake_init())
            self._swap = (a.detach(), self._fd)
            self._init_peer = b          # open until libfuse has read the INIT
            self._fd = self._swap[0]
        self.resent: bool | None = None  # taking over: whether the kernel took RESEND
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.ended = threading.Event()
        self.reads = 0
        self.read_errors = 0

    def start(self) -> None:
        """Starts serving; raises what pyfuse3's ``init`` raised (the descriptor isn't a FUSE
        mount, ...)."""
        self._thread = threading.Thread(target=self._run, name="fuse", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 2.0) -> None:
        """Stops answering (the mount stays; readers wait for the next server)."""
        token = self._token
        if token is not None and self.alive():
            try:
                trio.from_thread.run_sync(pyfuse3.terminate, trio_token=token)
            except (trio.RunFinishedError, RuntimeError):
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        ops = _Operations(self)
        try:
            pyfuse3.init(ops, f"/dev/fd/{self._fd}", set())
        except BaseException as e:  # reported to start()'s caller
            self._start_error = e
            os.close(self._fd)
            if self._swap is not None:
                os.close(self._swap[1])
            self._started.set()
            self.ended.set()
            return
        try:
            trio.run(self._main)
        except BaseException:
            log.exception("the FUSE server failed")
        finally:
            self._started.set()          # failed before serving: start() must not wait on
            # close() closes the descriptor pyfuse3 was given (our duplicate); the mount itself
            # is the CLI's to remove (``wagent umount``).
            pyfuse3.close(unmount=False)
            if self._init_peer is not None:
                self._init_peer.close()
            self.ended.set()
            log.info("the FUSE server ended")

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._started.set()
        await pyfuse3.main(min_tasks=4, max_tasks=MAX_TASKS)


class _Operations(pyfuse3.Operations):
    """The kernel's requests; a read-only tree, so no handler writes."""

    def __init__(self, server: FuseServer) -> None:
        super().__init__()
        self.s = server
        self.limiter = trio.CapacityLimiter(READ_THREADS)

    def init(self) -> None:
        """Called by libfuse once it has read INIT: when taking over, the made-up one; the real
        device goes under its number now (``fake_init``)."""
        swap = self.s._swap
        if swap is None:
            return
        placeholder, real = swap
        trio.lowlevel.notify_closing(placeholder)
        os.dup2(real, placeholder)
        os.close(real)
        self.s._swap = None
        try:
            os.write(placeholder, struct.pack("<IiQ", 16, FUSE_NOTIFY_RESEND, 0))
            self.s.resent = True
        except OSError as e:
            # Linux < 6.9 (Debian 12's 6.1): requests the dead server had read stay unanswered
            # until their readers are killed; new reads are served.
            self.s.resent = False
            log.warning("the kernel took no FUSE_NOTIFY_RESEND (%s): reads that were in flight "
                        "when the previous daemon died stay blocked (Linux >= 6.9 resends "
                        "them)", e.strerror)

    def _node(self, inode: int) -> Node:
        with self.s.lock:
            node = self.s.tree.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.inode
        a.generation = 0
        ttl = ROOT_TTL if node.inode == ROOT or node.parent == ROOT else IMMUTABLE_TTL
        a.entry_timeout = ttl
        a.attr_timeout = ttl
        a.st_mode = node.mode
        a.st_nlink = 2 + sum(1 for _ in node.children) if node.is_dir else 1
        a.st_uid = 0
        a.st_gid = 0
        a.st_size = node.size
        a.st_blksize = 1 << 20
        a.st_blocks = (node.size + 511) // 512
        with self.s.lock:
            v = self.s.tree.versions.get(node.entry)
        ns = int(v.published * 1e9) if v is not None else 0
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = ns
        return a

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext = None
                     ) -> pyfuse3.EntryAttributes:
        text = os.fsdecode(name)
        with self.s.lock:
            if text == ".":
                node = self.s.tree.nodes.get(parent_inode)
            elif text == "..":
                p = self.s.tree.nodes.get(parent_inode)
                node = None if p is None else self.s.tree.nodes.get(p.parent)
            else:
                node = self.s.tree.lookup(parent_inode, text)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(node)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext = None
                      ) -> pyfuse3.EntryAttributes:
        return self._attrs(self._node(inode))

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self._node(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        with self.s.lock:
            if fh not in self.s.tree.nodes:
                raise pyfuse3.FUSEError(errno.ENOENT)
            children = self.s.tree.listing(fh)
        # ``start_id`` is the position after the last entry the kernel took
        for i, child in enumerate(children[start_id:], start=start_id + 1):
            if not pyfuse3.readdir_reply(token, os.fsencode(child.name), self._attrs(child), i):
                return

    async def releasedir(self, fh: int) -> None:
        return None

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        fi = pyfuse3.FileInfo(fh=inode)
        fi.keep_cache = True        # immutable content: pages stay across opens
        return fi

    async def read(self, fh: int, off: int, size: int) -> bytes:
        node = self._node(fh)
        self.s.reads += 1
        try:
            if self.s.reader.complete(node):
                # A whole blob, read ahead by the kernel (the reader keeps it open): a pread
                # here costs less than the hop to a thread and back (measured: 0.62x of the
                # store's own throughput through threads)
                return self.s.reader.read(node, off, size)
            return await trio.to_thread.run_sync(self.s.reader.read, node, off, size,
                                                 limiter=self.limiter)
        except ReadFailed as e:
            self.s.read_errors += 1
            self.s.on_error(str(e))
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception as e:  # a bug: EIO for this read, not a dead server
            self.s.read_errors += 1
            log.exception("read of %s failed", node.name)
            self.s.on_error(f"internal error reading {node.name}: {e!r}")
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def release(self, fh: int) -> None:
        return None

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        return None

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = pyfuse3.StatvfsData()
        with self.s.lock:
            files = [n for n in self.s.tree.nodes.values() if not n.is_dir]
        st.f_bsize = st.f_frsize = BLOCK
        st.f_blocks = sum(n.size for n in files) // BLOCK
        st.f_bfree = st.f_bavail = 0
        st.f_files = len(files)
        st.f_ffree = st.f_favail = 0
        st.f_namemax = 255
        return st
