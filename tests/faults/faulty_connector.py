"""OffloadConnector with faults injected at the storage layer, for tests only.

Select it with `"kv_connector_module_path": "faults.faulty_connector"` (and
tests/ on PYTHONPATH): vLLM imports the module in every engine process, so
the faults below, read from $KVOFFLOAD_FAULTS (JSON), apply in the scheduler
and in the workers. Nothing of vLLM is replaced; the connector is ours,
unchanged; only file-system calls of our store misbehave:

- "slow_commit_s": every file write (`FsData.put`: checksum, write, rename,
  on the I/O pool) first sleeps this long: slow storage.
- "vanish_after_lookup": [{"group": g, "keys": [hex, ...], "how": "delete" |
  "corrupt"}, ...]: once per file, right after the scheduler's lookup saw one of these files, it
  is deleted or overwritten with garbage of the same size, i.e. between
  lookup and load.
- "enospc_while": a path; while it exists every file write fails with ENOSPC
  before writing (a full disk, where no small filesystem can be mounted).
- "eio_read_keys": [name, ...]: reads of the chunk files whose paths end in `name` + ".kv" fail with
  EIO (buffered and O_DIRECT reads): a key names that key's file in every group, a path tail
  ("g1/40/<key>") one file.
- "slow_read_s": every chunk file's payload read (buffered and O_DIRECT) first sleeps this long:
  slow storage under a load or warm start.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time

from offload import copier
from offload.connector import OffloadConnector  # noqa: F401  (what vLLM loads)
from offload.store import files, fs

FAULTS = json.loads(os.environ.get("KVOFFLOAD_FAULTS", "{}"))
_lock = threading.Lock()
VANISHED: set[tuple[int, str]] = set()


def _eio(path, names: tuple[str, ...]) -> bool:
    return str(path).endswith(tuple(n + ".kv" for n in names))


def _install() -> None:
    slow = float(FAULTS.get("slow_commit_s", 0))
    enospc = FAULTS.get("enospc_while")
    if slow or enospc:
        put = fs.FsData.put

        def faulty_put(self, header, chunk, placement):
            if slow:
                time.sleep(slow)
            if enospc and os.path.exists(enospc):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return put(self, header, chunk, placement)

        fs.FsData.put = faulty_put

    vanish = {(v["group"], k): v.get("how", "delete") for v in FAULTS.get("vanish_after_lookup", [])
              for k in v["keys"]}
    if vanish:
        contains = files.FileStore.contains

        def faulty_contains(self, group, key):
            found = contains(self, group, key)
            h = key.hex()
            if found and (group, h) in vanish:
                with _lock:
                    first = (group, h) not in VANISHED
                    VANISHED.add((group, h))
                if first:
                    path = self.file_path(group, key)
                    if vanish[(group, h)] == "delete":
                        os.unlink(path)
                    else:
                        n = path.stat().st_size
                        path.write_bytes(os.urandom(n))
            return found

        files.FileStore.contains = faulty_contains

    eio = tuple(FAULTS.get("eio_read_keys", []))
    slow_read = float(FAULTS.get("slow_read_s", 0))
    if eio or slow_read:
        read_file = copier.read_file

        def faulty_read(path, header_len, out, *args, **kwargs):
            if slow_read:
                time.sleep(slow_read)
            if _eio(path, eio):
                raise OSError(errno.EIO, "Input/output error (injected)", str(path))
            return read_file(path, header_len, out, *args, **kwargs)

        read_file_direct = copier.read_file_direct

        def faulty_read_direct(path, *args, **kwargs):
            if slow_read:
                time.sleep(slow_read)
            if _eio(path, eio):
                raise OSError(errno.EIO, "Input/output error (injected)", str(path))
            return read_file_direct(path, *args, **kwargs)

        copier.read_file = faulty_read
        copier.read_file_direct = faulty_read_direct  # the default (O_DIRECT) reads


_install()
