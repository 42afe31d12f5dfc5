"""An emitter's sites file (`<pid>-<hex>.sites`, beside its ring), read as it grows.

Each ring record names a site by id; the site's entry (consumer, tree, leaves, ...) is
appended to the sites file by the emitter when the site is first traced
(tapd/native/sites.py). The daemon reads what was appended since last time, checks each
entry (tapd/protocol/schema.py) and keeps it as a `Site`, or as the ProtocolError that
refused it, so that the records of a refused site are refused with the reason.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

from tapd.errors import ProtocolError
from tapd.native.sites import Site
from tapd.protocol.rules import DEFAULT_LIMITS
from tapd.protocol.schema import check_site_entry, split_site_entries

logger = logging.getLogger("tapd.daemon")


class RingSites:
    """The sites of one ring (`ring_path`, named in messages), read from `path`.
    `identity`: the fields every tap of this emitter carries (process, host, pid)."""

    def __init__(self, path: Path, ring_path: Path, identity: dict[str, Any]) -> None:
        self.path = path
        self.ring_path = ring_path
        self._identity = identity
        self._sites: dict[int, Site | ProtocolError] = {}  # a refused site: why
        self.version = 0  # grows as sites are read (tapd/daemon/wants.py)
        self._offset = 0
        self._broken: ProtocolError | None = None  # the sites file itself is bad

    def site(self, site_id: int) -> Site | ProtocolError | None:
        """The site a record names; a ProtocolError if its entry (or the whole sites
        file) was refused; None if its entry is not there yet."""
        if site_id not in self._sites and self._broken is None:
            try:
                self._read()
            except ProtocolError as exc:
                self._broken = exc
                logger.error(
                    "sites file %s of ring %s refused: %s; the taps of its unknown "
                    "sites are refused",
                    self.path,
                    self.ring_path,
                    exc,
                )
        found = self._sites.get(site_id)
        return found if found is not None or self._broken is None else self._broken

    def known(self) -> dict[int, Site]:
        """The sites read so far (refused ones left out), by site id."""
        return {i: site for i, site in self._sites.items() if isinstance(site, Site)}

    def ids(self) -> list[int]:
        """The ids of every site read so far, refused ones too."""
        return list(self._sites)

    def consumer_of(self, site_id: int) -> str:
        """The consumer of a site, for counts and messages ("site N" if none is known)."""
        site = self._sites.get(site_id)
        return site.consumer if isinstance(site, Site) else f"site {site_id}"

    def read_new(self) -> None:
        """Read the entries appended since last time (a refused file is reported where
        its records are: `site`)."""
        if self._broken is None:
            try:
                self._read()
            except ProtocolError:
                pass

    def _read(self) -> None:
        """Read the entries appended since last time: a regular file, not a link, at most
        `max_sites_bytes` in all; each entry checked (tapd/protocol/schema.py)."""
        limits = DEFAULT_LIMITS
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # not written yet
        except OSError as exc:
            raise ProtocolError(
                "bad_ring", f"cannot open sites file {self.path}: {exc.strerror}"
            ) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise ProtocolError(
                    "bad_ring", f"sites file {self.path} is not a regular file of ours"
                )
            if info.st_size > limits.max_sites_bytes:
                raise ProtocolError(
                    "bad_ring",
                    f"sites file {self.path} has "
                    f"{info.st_size} bytes; the limit is "
                    f"{limits.max_sites_bytes}",
                )
            data = os.pread(fd, max(0, info.st_size - self._offset), self._offset)
        finally:
            os.close(fd)
        try:
            entries, used = split_site_entries(data, limits)
        except ProtocolError as exc:
            raise ProtocolError("bad_ring", f"sites file {self.path}: {exc}") from exc
        self._offset += used
        for entry in entries:
            site_id = entry.get("site") if isinstance(entry, dict) else None
            try:
                check_site_entry(entry, limits)
                site: Site | ProtocolError = Site(entry, self._identity)
            except ProtocolError as exc:
                if type(site_id) is not int:
                    raise ProtocolError(
                        "bad_ring",
                        f"sites file {self.path}: an entry without a site id: {exc}",
                    ) from exc
                site = exc
                logger.error("ring %s: tap site %d refused: %s", self.ring_path, site_id, exc)
            assert type(site_id) is int
            self._sites[site_id] = site
        self.version += bool(entries)
