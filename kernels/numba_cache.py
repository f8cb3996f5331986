"""numba's on-disk cache, safe for processes that compile at the same time.

numba (0.65 and before; numba issues #4807 and #10128) saves a compiled
overload by reading the function's cache index, taking the first data-file
name the index does not use, writing the index back, then the data, with no
lock. Two processes that compile two signatures of one function at once (two
pytest-xdist workers, two vLLM processes on a fresh install) can both read
the index before either writes it: both take the same name, the index keeps
one signature, and the data file holds whichever process wrote last, so a
later process may load machine code compiled for other argument types.

:func:`lock_cache_saves` makes every save hold an advisory lock
(``fcntl.flock``) on one file in the cache directory, so the second save
reads the index the first one wrote. Loads stay lock-free: each file is
replaced atomically, and numba already treats a data file that is not there
yet as a miss. Every kvhit module that compiles with ``cache=True`` calls it
right after importing numba; it patches numba once per process, and then
covers every cached function of the process, kvhit's or not (a save only
waits for another save in the same directory).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["LOCK_NAME", "lock_cache_saves"]

#: The lock file, one per cache directory (``__pycache__`` beside the
#: sources, or ``NUMBA_CACHE_DIR``).
LOCK_NAME = ".numba-save.lock"


def lock_cache_saves() -> bool:
    """Makes numba's cache saves in this process take :data:`LOCK_NAME`'s
    lock (idempotent). Returns whether saves are locked: False where
    ``fcntl`` is missing (not POSIX) or numba's cache class is not the one
    this patch knows, which leaves numba as it is."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - POSIX everywhere kvhit runs
        return False
    from numba.core import caching

    cls = getattr(caching, "IndexDataCacheFile", None)
    save = getattr(cls, "save", None)
    if save is None:  # pragma: no cover - a numba whose cache we do not know
        return False
    if getattr(save, "_kvhit_locked", False):
        return True

    def locked_save(self: Any, key: Any, data: Any) -> None:
        directory = getattr(self, "_cache_path", None)
        fd = -1
        if directory is not None:
            try:
                fd = os.open(
                    os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666
                )
            except OSError:
                fd = -1  # an unwritable directory: numba's save fails there too
        if fd < 0:
            return save(self, key, data)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return save(self, key, data)
        finally:
            os.close(fd)  # releases the lock

    locked_save._kvhit_locked = True  # type: ignore[attr-defined]
    locked_save.__wrapped__ = save  # type: ignore[attr-defined]
    locked_save.__doc__ = save.__doc__
    cls.save = locked_save
    return True
