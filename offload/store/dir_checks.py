"""The start-up checks of a cache directory, for a tier that keeps files: `check_directory` (it
is a directory this user can create and write) and `unauthenticated_risks` (why, without a
key, it may hold entries this user did not write)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from offload.store.base import OptionError
from offload.store.cachedir import hygiene
from offload.store.cachedir.paths import LEDGER_DIR, LOG_NAME, top_dir
from offload.store.options import not_a_directory


def unauthenticated_risks(path: str) -> list[str]:
    """Why a cache directory without a key may hold entries that this user did
    not write: directories writable by group or others, ledger logs of
    other users or hosts. Empty when neither is seen."""
    out = []
    base = Path(path)
    for d in (base, top_dir(base)):
        try:
            mode = stat.S_IMODE(os.stat(d).st_mode)
        except OSError:
            continue
        if mode & 0o022:
            out.append(f"{d} is writable by its group{' and others' if mode & 0o002 else ''} (mode {mode:04o})")
    ledger = top_dir(base) / LEDGER_DIR
    users, hosts = set(), set()
    try:
        for e in os.scandir(ledger):
            m = LOG_NAME.match(e.name)
            if m is not None:
                try:
                    users.add(e.stat(follow_symlinks=False).st_uid)
                except OSError:
                    continue
                hosts.add(m.group("host"))
    except OSError:
        pass
    if users - {os.getuid()}:
        out.append(f"the ledger ({ledger}) has logs of {len(users - {os.getuid()})} other user(s)")
    if hosts - {hygiene.HOST_TAG}:
        out.append(f"the ledger ({ledger}) has logs of {len(hosts - {hygiene.HOST_TAG})} other host(s)")
    return out


def check_directory(path: str, mode: int) -> None:
    """The cache directory exists (created with `mode` if missing), is a
    directory, and this user can write it; OptionError naming `path` otherwise."""
    p = Path(path)
    problem = not_a_directory(path)  # checked again here: the config may have been validated elsewhere
    if problem:
        raise OptionError(f"path={path!r}: {problem}")
    try:
        p.mkdir(parents=True, exist_ok=True, mode=mode)
    except OSError as e:
        raise OptionError(f"path={path!r}: cannot create the cache directory ({e.strerror}); "
                          "choose a directory this user can create or write") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise OptionError(f"path={path!r}: directory is not writable by this user; "
                          "fix its permissions or choose another path")
