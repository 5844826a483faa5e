"""The commit protocol every take ends with, single-process or distributed (docs/format.md).

Called by the one process that commits (rank 0 of a distributed take) once
every chunk the manifest names is durable, inside the take's lease:

1. write the manifest (named by its hash; create-only, so rewriting the same
   bytes is harmless);
2. check the lease is still ours: a take stalled past its lease may have been
   declared dead and its unreferenced chunks swept, so it must not commit;
3. write the ref, create-only: the commit point. Before it nothing is visible;
4. remember it: the session's lineage, the reuse cache for the next take
   (casnap.take.reuse), and the local index's summary (so ``log`` need not
   read the manifest back).
"""

from __future__ import annotations

from collections.abc import Mapping

from casnap import index
from casnap.format.manifest import Dumped, Manifest
from casnap.format.manifest_bytes import entry_texts
from casnap.repo.leases import Lease
from casnap.repo.repository import RepoStorage
from casnap.take.reuse import REUSE
from casnap.take.session import Session


def commit_snapshot(
    repo: RepoStorage,
    name: str,
    manifest: Manifest,
    *,
    lease: Lease | None,
    session: Session | None,
    previous: Dumped | None = None,
) -> tuple[str, Manifest]:
    """Steps 1 to 4 above; returns the manifest's hash and the manifest as stored (its
    ``parts`` listed: docs/format.md, "Manifest parts").

    ``previous`` (the parent's manifest and its JSON form, from the reuse
    cache) lets the serializer reuse the JSON of the entries the two share.
    """
    # A distributed take's manifest is written per entry object, not per key (its
    # 1,024 ranks' keys would each be dumped again): no key's text is needed.
    texts = None if manifest.writes_rank_groups() else entry_texts(manifest, previous)
    manifest_hash, manifest = repo.write_manifest(manifest, texts)  # as stored: its parts
    if lease is not None:
        lease.check()
    repo.write_ref(name, manifest_hash)  # the commit point
    remember(repo, manifest_hash, manifest, session, texts, committed=True)
    return manifest_hash, manifest


def remember(
    repo: RepoStorage,
    manifest_hash: str,
    manifest: Manifest,
    session: Session | None,
    texts: Mapping[str, str] | None = None,
    *,
    committed: bool = False,
) -> None:
    """Step 4 (``committed``: this process just committed the manifest; ``texts``: its
    JSON per key, when serialized here): the session's lineage, the reuse cache and the
    index's summary. A snapshot restored, or committed by another rank, is only the
    session's parent for its next take, and what that take reuses."""
    if session is not None:
        session.lineage.record(repo.config.repo_id, manifest_hash)
    elif not committed:
        return
    record = REUSE.put(repo.config.repo_id, manifest_hash, manifest, _dumped(manifest, texts))
    if committed:
        index.record_manifest(repo, manifest_hash, manifest, record.summary)


def _dumped(manifest: Manifest, texts: Mapping[str, str] | None) -> Dumped | None:
    return Dumped(manifest, texts) if texts is not None else None
