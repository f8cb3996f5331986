"""numba's on-disk cache, safe for processes that compile at the same time.

numba (0.65 and before; numba issues #4807 and #10128) saves a compiled
overload by reading the function's cache index, taking the first data-file
name the index does not use, writing the index back, then the data, with no
lock. Two processes that compile two signatures of one function at once (two
pytest-xdist workers, two vLLM processes on a fresh install) can both read
the index before either writes it: both take the same name, the index keeps
one signature, and the data file holds whichever process wrote last, so a
later process may load machine code compiled for other argument types. A
load that runs between a save's index and its data (after a source edit
numbering restarts at 1 while the old data files are still there) can read
the previous build's code the same way.

:func:`lock_cache_saves` makes every save hold an exclusive and every load
a shared POSIX record lock (``fcntl.lockf``) on one file in the cache
directory, so a save reads the index the previous save wrote and a load
sees an index and its data written together. Record locks belong to the
process: a child forked while a save runs does not inherit the lock (a
``flock`` would keep it held in the child), and taking it again in the same
process cannot deadlock. Where the lock file cannot be opened or locked (a
read-only directory, a filesystem without locks) numba runs as it did.
Every kvhit module that compiles with ``cache=True`` calls it right after
importing numba; it patches numba once per process and then covers every
cached function of the process, kvhit's or not.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["LOCK_NAME", "lock_cache_saves"]

#: The lock file, one per cache directory (``__pycache__`` beside the
#: sources, or ``NUMBA_CACHE_DIR``).
LOCK_NAME = ".numba-save.lock"

_PATCH_LOCK = threading.Lock()
_MARK = "_kvhit_cache_locked"


@contextlib.contextmanager
def _held(directory: str | None, exclusive: bool) -> Iterator[None]:
    import fcntl

    fd = -1
    if directory is not None:
        path = os.path.join(directory, LOCK_NAME)
        # A lock file another user made (0644 under their umask) still
        # opens for reading, which a shared lock needs.
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
            try:
                fd = os.open(path, flags, 0o666)
                break
            except OSError:
                continue
    if fd >= 0:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError:
            os.close(fd)
            fd = -1
    try:
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the process's lock


def lock_cache_saves() -> bool:
    """Makes numba's cache saves and loads in this process take
    :data:`LOCK_NAME`'s lock (idempotent, thread-safe). Returns whether they
    do: False where ``fcntl`` is missing (not POSIX) or numba's cache class
    is not the one this patch knows, which leaves numba as it is."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - POSIX everywhere kvhit runs
        return False
    from numba.core import caching

    cls = getattr(caching, "IndexDataCacheFile", None)
    save = getattr(cls, "save", None)
    load = getattr(cls, "load", None)
    if save is None or load is None:  # pragma: no cover - another numba
        return False
    with _PATCH_LOCK:
        if getattr(cls, _MARK, False):
            return True

        def locked_save(self: Any, key: Any, data: Any) -> None:
            with _held(getattr(self, "_cache_path", None), exclusive=True):
                return save(self, key, data)

        def locked_load(self: Any, key: Any) -> Any:
            with _held(getattr(self, "_cache_path", None), exclusive=False):
                return load(self, key)

        for new, old in ((locked_save, save), (locked_load, load)):
            new.__doc__ = old.__doc__
            new.__wrapped__ = old  # type: ignore[attr-defined]
        cls.save = locked_save
        cls.load = locked_load
        setattr(cls, _MARK, True)
    return True
