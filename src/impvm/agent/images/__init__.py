"""Image preparation for the node agent: pull by digest, verify, unpack, add runner layer, cache.

Rules (the runner image contract: an immutable base image plus a runner layer, pulled by digest,
never by tag):

* A reference must be pinned (``REPO@sha256:<64 hex>``, a tag may precede the digest and is then
  ignored). A tag-only reference is refused with :class:`ImageError` unless ``allow_unpinned``;
  then the tag is resolved to a digest once and everything after uses the digest.
* Pulling uses Debian's ``skopeo`` (``docker://REPO@DIGEST`` into a private OCI layout). Before
  the copy the raw manifest is fetched (``skopeo inspect --raw``) and its sha256 must equal the
  pinned digest; skopeo's copy by digest verifies the same again, so a registry cannot swap content.
* Before the pull, the sizes the manifest declares (config and layers) must fit the cache's cap
  (``max_bytes``), so an image too big for the node is refused without a byte fetched.
* Assembly (:mod:`impvm.agent.layers`): the runner layer image's layers are stacked onto the base
  image's in one OCI image, every layer is read once as a stream and judged before anything is
  written (no entry, hard link or relative symlink leaving the root, no device node, the whole
  image within the cache's cap: a decompression bomb stops at the cap having written nothing),
  and ``umoci raw unpack`` (``--rootless`` when not root) writes the stacked image: umoci
  resolves every path inside the root (``securejoin``) and replaces a lower layer's symlink
  instead of writing through it, so no path of the image reaches the host. Whiteouts, ownership,
  modes and symlinks are umoci's; the runner layer may also delete files of the base image.
* Signatures (:mod:`impvm.agent.signing`): with ``public_key`` each pinned reference is checked
  by ``cosign verify`` right before skopeo copies that same digest, so an unsigned, wrongly
  signed or tampered image or runner layer is refused before a layer is fetched
  (:class:`~impvm.agent.signing.SignatureError` names it and says why).
* Prepared images are cached under ``cache_dir/images/<key>`` where ``key`` is derived from the
  pair (image manifest digest, runner-layer manifest digest) and, for a verified entry, from the
  key's fingerprint and both repositories: an entry verified against one key (or pulled without
  verification) is never handed to a request that requires another key; that request pulls and
  verifies again. A finished entry is made read-only
  (write bits removed recursively) and is never written by VMs (runtimes mount it read-only).
  A runtime may keep artifacts built from an entry (the ``qemu`` runtime's ext4 image disk) inside
  it (:meth:`ImageStore.derived`), so they count towards the cap and go with their entry.
  The total size is capped at ``max_bytes`` with least-recently-used eviction; entries retained by
  a running VM (:meth:`ImageStore.retain`) are never evicted by this process.
* Concurrent preparation of the same pair runs once per process (an asyncio lock per key) and is
  safe across processes: each build happens in a private temp dir and is published with an atomic
  ``rename``; a loser of the race discards its copy and uses the winner's.

All subprocesses run through :func:`asyncio.create_subprocess_exec`; blocking file-tree walks run
in a worker thread.

Modules: :mod:`~impvm.agent.images.refs` (references and digests),
:mod:`~impvm.agent.images.pull` (skopeo), :mod:`~impvm.agent.images.unpack` (umoci),
:mod:`~impvm.agent.images.cache` (entries, the cap, LRU eviction),
:mod:`~impvm.agent.images.tree` (file trees), :mod:`~impvm.agent.images.store` (the store).
"""

from impvm.agent.images.cache import EvictedError, PreparedImage, cache_key
from impvm.agent.images.refs import ImageRef, parse_reference
from impvm.agent.images.store import ImageStore

__all__ = [
    "EvictedError",
    "ImageRef",
    "ImageStore",
    "PreparedImage",
    "cache_key",
    "parse_reference",
]
