"""The name of a blob in the store: a digest of the file's verified pieces, never a claim.

A manifest says three things about a file: its size, its pieces (offset, size, sha256) and its
sha256. The first two are proven by the pull itself: every piece is hashed as it arrives and the
pieces tile the file, so a file whose pieces all verified *is* the byte sequence their digests
name. The whole-file sha256 is not proven unless the file is read once more; a buggy or hostile
manifest may claim a real file's sha256 over bytes of its own. So blobs are named by what was
proven::

    blob_id = sha256("wagent-blob 1\\n" "<size>\\n" "<piece size> <piece sha256>\\n" ...)

A Merkle-style root of depth one: two files have the same id only if every piece has the same
size and digest, in the same order, which (sha256 being collision resistant) means the same bytes.
A second manifest that lists the same pieces (the same bytes) shares the blob; one that claims
the same file sha256 over other bytes gets another id, so it can never put its bytes under a name
that an honest version links to. Costs nothing per byte: the piece digests are computed anyway.

The publisher's sha256 stays in the manifest as an attribute: ``--verify-files`` re-reads each
file and checks it.
"""

from __future__ import annotations

import hashlib

from agent.manifest import FileEntry

_TAG = b"wagent-blob 1\n"


def blob_id(f: FileEntry) -> str:
    h = hashlib.sha256(_TAG)
    h.update(b"%d\n" % f.size)
    h.update("".join(f"{p.size} {p.sha256}\n" for p in f.pieces).encode())
    return h.hexdigest()
