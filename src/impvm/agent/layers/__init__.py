"""Image layers judged before any of their bytes reach the disk, and a runner layer stacked onto
its base image as one OCI image, so that ``umoci`` writes every path of both inside one root.

Why: an image is input from outside (its publisher is not trusted), and the agent unpacks it as
root. Every path a layer writes must resolve inside the image's root, and the image may not be
bigger than the node's image cache.

* **Stacking** (:func:`stack_images`): the runner layer image's layers are appended to the base
  image's (manifest ``layers`` and config ``rootfs.diff_ids``, OCI image spec "Image Manifest"
  and "Image Configuration") under a new tag in the same OCI layout, and ``umoci raw unpack``
  applies them in order. umoci resolves the directory of every entry inside the root
  (``securejoin``, the scoped path resolution runc and containerd use), replaces whatever the
  lower layers left at an entry's own path instead of following it, scopes hard-link targets to
  the root and applies whiteouts: a base image's symlink at ``usr/local/bin/runner`` pointing to
  a host file is replaced by the runner layer's file, never written through.
* **Rules checked first** (:func:`entry_problem`, pure), the breakout rules of Docker's layer
  extraction (moby ``pkg/archive``: "invalid hardlink", "invalid symlink", breakout errors): an
  entry's name may not leave the root through ``..``; a hard link's target, taken from the
  root, may not leave it; a relative symlink's target, taken from the link's directory, may not
  leave it (an absolute target is resolved inside the root, by umoci here and by the guest at run
  time); and, beyond Docker, no character or block device node (an OCI layer carries none: the
  runtime provides ``/dev``; a device node in the cache would give whoever opens it a host
  device). A layer breaking one is refused whole (:class:`ImageRefused`), naming the layer, the
  entry and the rule.
* **Size while reading** (:func:`check_layers`): each layer is decompressed as a stream and its
  tar headers are read with ``tarfile`` without extracting anything; every entry is charged
  :data:`ENTRY_BYTES` plus its data rounded up to 4 KiB blocks (a directory one block) against
  one budget for the whole image, the image cache's size cap. The first entry that passes the
  budget stops the read (:class:`ImageTooLarge`): a small compressed layer that expands beyond
  the cap (a decompression bomb) costs the time to inflate up to the cap and no disk at all. No
  single read is larger than :data:`MAX_HEADER_BYTES` (``tarfile`` reads a PAX or GNU long-name
  header whole), so memory stays bounded too.

The layout and its blobs are private to the agent (the image store's temp dir, 0700) and umoci
verifies every blob against its digest as it reads, so what umoci unpacks is what was checked.
"""

from impvm.agent.layers.oci import (
    declared_bytes,
    layer_blobs,
    platform_manifest,
    stack_images,
    stacked,
    tagged_manifest,
)
from impvm.agent.layers.rules import (
    BLOCK_BYTES,
    ENTRY_BYTES,
    Budget,
    ImageRefused,
    ImageTooLarge,
    entry_cost,
    entry_problem,
)
from impvm.agent.layers.scan import MAX_HEADER_BYTES, LayerBlob, check_layers, scan_layer

__all__ = [
    "BLOCK_BYTES",
    "ENTRY_BYTES",
    "MAX_HEADER_BYTES",
    "Budget",
    "ImageRefused",
    "ImageTooLarge",
    "LayerBlob",
    "check_layers",
    "declared_bytes",
    "entry_cost",
    "entry_problem",
    "layer_blobs",
    "platform_manifest",
    "scan_layer",
    "stack_images",
    "stacked",
    "tagged_manifest",
]
