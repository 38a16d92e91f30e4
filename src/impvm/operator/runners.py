"""The runner directory: GitHub's runner registrations listed once per installation and scope,
shared by every pool of it.

Each pool's pass asks for its own registrations (by name prefix) and says how old a list it
accepts (:func:`impvm.scaling.runnerlist.max_list_age`). The directory answers from the last
list of the scope (``GET /orgs/{org}/actions/runners`` or the repository form: every page, each
revalidated with its ETag, so an unchanged page is a 304) when that list is fresh enough
(:meth:`impvm.scaling.runnerlist.Listing.usable`), else lists again. Requests that arrive while a
list is under way, and accept it, wait for that one call instead of making their own. A pool that
created or deleted a registration says so (:meth:`RunnerDirectory.changed`): no list whose
request started before that is used for it again.

A failed list is shared too: the pools that wait for it, and those asking within
``error_reuse_seconds``, get the same :class:`~impvm.github.errors.GitHubError`, which each
pool's pass turns into its condition and its own backoff (:mod:`impvm.scaling.world`), as before.

The reaper and pool teardown keep their own reads (a reaper pass lists the runners it judges;
teardown lists the pool's runners once before deregistering them): both are rare, and both must
see GitHub's state at that moment.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from dataclasses import dataclass, field

from impvm.github import GitHubClient, Runner, Scope
from impvm.github.errors import GitHubError
from impvm.scaling.runnerlist import Listing

log = logging.getLogger("impvm.operator.runners")


@dataclass
class _Entry:
    """One installation and scope: its last list, the list under way, and when each pool (by
    name prefix) last changed its registrations (monotonic seconds)."""

    listing: Listing | None = None
    result: list[Runner] | GitHubError | None = None
    running: tuple[Listing, asyncio.Future[list[Runner]]] | None = None
    changed: dict[str, float] = field(default_factory=dict)
    #: ``result`` sorted by name, and its names: each pool's share is one range of it
    by_name: tuple[list[str], list[Runner]] | None = None

    def share(self, result: list[Runner], prefix: str) -> list[Runner]:
        """The runners of ``result`` whose names start with ``prefix`` (a binary search in the
        list sorted once, not a scan per pool: 100 pools share a list of 2,000 runners)."""
        if result is not self.result:
            return [r for r in result if r.name.startswith(prefix)]
        if self.by_name is None:
            ordered = sorted(result, key=lambda r: r.name)
            self.by_name = ([r.name for r in ordered], ordered)
        names, ordered = self.by_name
        lo = bisect.bisect_left(names, prefix)
        hi = lo
        while hi < len(names) and names[hi].startswith(prefix):
            hi += 1
        return ordered[lo:hi]


class RunnerDirectory:
    """Shared runner lists, keyed by (client, scope): one client per credential identity
    (:class:`~impvm.operator.credentials.GitHubProvider`), so a list read with one key is
    never handed to a pool holding another."""

    def __init__(self, error_reuse_seconds: float = 2.0) -> None:
        self.error_reuse_seconds = error_reuse_seconds
        self._entries: dict[tuple[GitHubClient, str], _Entry] = {}
        #: list calls made (each all pages of one scope)
        self.lists = 0

    def _entry(self, client: GitHubClient, scope: Scope) -> _Entry:
        key = (client, str(scope))
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        return entry

    async def runners(
        self, client: GitHubClient, scope: Scope, prefix: str, max_age: float, mono: float
    ) -> list[Runner]:
        """The registrations of ``scope`` whose names start with ``prefix``, from a list at
        most ``max_age`` seconds old at monotonic ``mono`` and begun after the pool's last
        change. Raises the list's :class:`GitHubError`."""
        entry = self._entry(client, scope)
        changed = entry.changed.get(prefix)
        result: list[Runner] | GitHubError | None = None
        if entry.listing is not None and entry.result is not None:
            ok = not isinstance(entry.result, GitHubError)
            age = max_age if ok else min(max_age, self.error_reuse_seconds)
            if entry.listing.usable(mono, age, changed):
                result = entry.result
        if result is None:
            if entry.running is not None and entry.running[0].usable(mono, max_age, changed):
                fut = entry.running[1]
            else:
                fut = self._start(entry, client, scope, mono)
            try:
                result = await asyncio.shield(fut)
            except GitHubError as e:
                result = e
        if isinstance(result, GitHubError):
            raise result
        return list(entry.share(result, prefix))

    def _start(
        self, entry: _Entry, client: GitHubClient, scope: Scope, mono: float
    ) -> asyncio.Future[list[Runner]]:
        """Begin one list of ``scope``; its answer becomes the entry's list unless a list that
        began later already did."""
        listing = Listing(started=mono)
        task = asyncio.ensure_future(client.list_runners(scope))
        entry.running = (listing, task)
        self.lists += 1

        def done(t: asyncio.Future[list[Runner]]) -> None:
            if entry.running is not None and entry.running[1] is t:
                entry.running = None
            if t.cancelled():
                return
            err = t.exception()
            if err is not None and not isinstance(err, GitHubError):
                return  # not GitHub's answer (e.g. a bug): nothing to share
            if entry.listing is None or entry.listing.started <= listing.started:
                entry.listing = listing
                entry.result = err if isinstance(err, GitHubError) else t.result()
                entry.by_name = None

        task.add_done_callback(done)
        return task

    def changed(self, client: GitHubClient, scope: Scope, prefix: str, mono: float) -> None:
        """A pool (runner name ``prefix``) created or deleted a registration of ``scope`` at
        monotonic ``mono``: it uses no list begun before then."""
        entry = self._entry(client, scope)
        entry.changed[prefix] = max(mono, entry.changed.get(prefix, mono))

    def forget_client(self, client: GitHubClient) -> None:
        """``client`` is retired (its key was rotated away): its lists go with it."""
        for key in [k for k in self._entries if k[0] is client]:
            del self._entries[key]

    def forget(self, prefix: str) -> None:
        """A pool is gone: drop what was kept for it."""
        for entry in self._entries.values():
            entry.changed.pop(prefix, None)
