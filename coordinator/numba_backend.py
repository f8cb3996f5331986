"""The numba backend of the LookupEngine: the CPU default.

Glue between a :class:`ScanPlan` and the compiled per-request programs of
:mod:`kvhit.kernels.scan_numba`: the batch's hash rows, the KeyIndex table and
the plan's rows go in as zero-copy numpy views of the torch tensors, and one
compiled call answers the whole batch (both searches of the store worker's
``lookup`` included).

Importing this module does not import numba (``coordinator/`` never does at
import time); the kernel module, and numba with it, is imported on the first
call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvhit.coordinator.backend import (
    RUN_FIND,
    RUN_FIND_EAGLE,
    RUN_LOOKUP,
    check_runs_on,
)
from kvhit.coordinator.int_lists import decoder_ready, encode_step
from kvhit.coordinator.plan import ScanPlan, plan_tensors
from kvhit.kernels.checks import host_lengths, host_lengths_or_int

if TYPE_CHECKING:
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch, RaggedView

__all__ = ["NumbaBackend"]

_INT64 = np.dtype(np.int64)
_INT64_MAX = (1 << 63) - 1


def _np(t: torch.Tensor) -> np.ndarray:
    # A CPU tensor's numpy view shares its memory (integer tensors never
    # require grad); the launcher copies only what is not contiguous.
    return t.numpy()


def _c(t: torch.Tensor | np.ndarray) -> np.ndarray:
    # An int64 CPU tensor (kvhit's own, or a length tensor the engine checked)
    # as C-contiguous numpy: a view when it already is one (the usual case),
    # else a copy. All scan_prepared needs beyond what the engine checked.
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.int64)


def _table(index: KeyIndex) -> np.ndarray:
    table = index.table
    if isinstance(table, torch.Tensor):
        return _np(table)
    return np.asarray(table)


# The lengths' name in a runner's errors, by mode (backend.RUN_MODES).
_LENGTHS_NAME = ("max_lengths", "max_lengths", "num_tokens")


def _same_modes(sn: Any) -> None:
    """The runners hand a mode of ``backend.RUN_MODES`` to the kernels as
    theirs: the two numberings must be one."""
    if (sn.FIND, sn.FIND_EAGLE, sn.LOOKUP) != (RUN_FIND, RUN_FIND_EAGLE, RUN_LOOKUP):
        raise AssertionError("scan_numba's modes differ from backend.RUN_MODES")


class NumbaBackend:
    """Compiled CPU per-request programs (the ``Backend`` protocol of
    ``coordinator/backend.py``).

    Args:
        plan: the layout's ScanPlan.
        device: must be the CPU.

    Attributes:
        parallel: threads over requests (True), a serial loop (False), or by
            batch size (None, the default: threads from
            ``kvhit.kernels.scan_numba.PARALLEL_MIN_REQUESTS`` requests on).

    Raises:
        ValueError: ``device`` is not the CPU.
    """

    name = "numba"

    def __init__(self, plan: ScanPlan, device: torch.device) -> None:
        device = torch.device(device)
        check_runs_on(self.name, device)
        self.plan = plan
        self._params = plan.params  # built once: ScanPlan.params is a property
        self.device = device
        self.parallel: bool | None = None
        sg_rows, cand_rows = plan_tensors(plan, device)
        self._sg = _np(sg_rows)
        self._cand = _np(cand_rows)
        self._prep_cache = None
        self._run: Callable[[np.ndarray, Any, np.ndarray, int], int] | None = None
        self._run_many: Callable[[tuple, Any, np.ndarray, int], np.ndarray] | None = (
            None
        )
        # The lists runner: None until made (lists_runner hands out
        # _lazy_lists until then), False where it cannot be (no msgspec).
        self._run_lists: Callable[..., list[int] | None] | bool | None = None

    def _prep(self) -> tuple[Any, Any]:
        """``(scan_numba module, ScanPrep)``: the plan's rows and parameter
        vectors checked and built once (the kernel module, and numba with
        it, imported on the first call)."""
        if self._prep_cache is None:
            from kvhit.kernels import scan_numba as sn

            prep = sn.prepare_scan(self._sg, self._cand, self._params)
            self._prep_cache = (sn, prep)
        return self._prep_cache

    def warm_up(self) -> None:
        """``BatchBackend.warm_up``: the plan's rows built and the compiled
        batch programs loaded (or compiled, on a cold cache) now, and
        ``from_ints``' list decoder with them, and the lists runner
        (:meth:`lists_runner`, its program ``kernels/scan_numba_lists.py``)."""
        sn, prep = self._prep()
        sn.warm_up(prep)
        decoder_ready()
        if self._run_lists is None:
            self._make_lists_runner()

    # -- the host path: the engine's calls, without torch in the loop --------
    #
    # A scheduler step of one request costs ~1 us in the compiled kernel; a
    # RaggedView of torch tensors, tensor->numpy views and the launcher's
    # checks around it cost several times that. Here the plan's rows and
    # parameter vectors are checked and built once per backend (_prep), the
    # batch's arrays once per batch (HashBatch.host_arrays), the table's view
    # once per table tensor (_host_table), and the lengths once, as numpy, by
    # the engine through lengths(); scan_prepared checks nothing.

    def lengths(self, value: Any, name: str, n: int) -> np.ndarray | int:
        """See ``BatchBackend.lengths``: C-contiguous int64 numpy ``[n]``, or
        one request's length as an int (``checks.host_lengths_or_int``: the
        one-request path makes no array)."""
        return host_lengths_or_int(value, name, n)

    def _host_table(self, index: KeyIndex) -> np.ndarray:
        """``index.table`` as C-contiguous int64 numpy: the index's own view
        (made once per table tensor, so nothing here keeps a dropped table
        alive), or a copy on every call for a table that needs one (a cached
        copy would miss later inserts)."""
        arr = index.table_view
        # ``is``: comparing a dtype with np.int64 converts the type each time.
        if arr is not None and arr.dtype is _INT64 and arr.flags.c_contiguous:
            return arr
        return _c(_table(index))

    def one_runner(
        self, index: KeyIndex
    ) -> Callable[[np.ndarray, Any, np.ndarray, bool], int] | None:
        """See ``BatchBackend.one_runner``: for an index of 8-byte keys whose
        table has a usable host view, ``run(rows, max_lengths, table,
        apply_eagle)`` answering a checked one-request batch of 8-byte keys
        (``rows`` its int64 ``[n]`` values, ``HashBatch.one_values``) as
        ``find_batch`` does, its hit an int; ``table`` is the index's
        ``table_view`` (the runner keeps no table alive), its layout tested
        here (the engine asks again when the table changes); ``max_lengths``
        in any form, checked here (one request). One runner per backend,
        made on first use (the compiled entry and the packed plan looked up
        then): a router that switches indexes pays only this test."""
        table = index.table_view
        if (
            index.hash_bytes != 8
            or table is None
            or table.dtype is not _INT64
            or not table.flags.c_contiguous
        ):
            return None
        return self._run or self._make_runner()

    def _make_runner(self) -> Callable[[np.ndarray, Any, np.ndarray, int], int]:
        sn, prep = self._prep_cache or self._prep()
        _same_modes(sn)
        entry = sn.one_entry(prep)
        plan = prep.one
        lengths = host_lengths_or_int

        def run(rows: np.ndarray, max_lengths: Any, table: Any, mode: int) -> int:
            one = max_lengths
            if type(one) is np.ndarray and one.dtype is _INT64 and one.size == 1:
                # A router's int64 slice [1] as its tolist(): [v] for [1]
                # alone (0-d gives an int, [1, 1] a list in a list), then the
                # list's test below; one call where host_lengths_or_int's
                # array test makes three (cold, in the alternate order: the
                # step's find 6.1-6.5 -> 5.4-5.8 us).
                one = one.tolist()
            # host_lengths_or_int's one-item list of an int, inline.
            if not (
                type(one) is list
                and len(one) == 1
                and type(m := one[0]) is int
                and 0 <= m <= _INT64_MAX
            ):
                m = lengths(max_lengths, _LENGTHS_NAME[mode], 1)
                if type(m) is not int:
                    m = m.item(0)
            # prefetching(1, table), spelled out (read at call time).
            pf = (
                sn.PREFETCH_MIN_REQUESTS <= 1
                and table.nbytes >= sn.PREFETCH_MIN_TABLE_BYTES
            )
            return entry(rows, m, table, plan, 2 * mode + pf)

        self._run = run
        return run

    def batch_runner(
        self, index: KeyIndex
    ) -> Callable[[tuple, Any, np.ndarray, int], np.ndarray] | None:
        """See ``BatchBackend.batch_runner``: where :meth:`one_runner` has a
        runner, ``run(host, lengths, table, mode)`` answering a batch of
        8-byte keys from its ``host_arrays()`` as :meth:`find_batch` (no
        spans) or :meth:`lookup_batch` does (int64 numpy ``[B]``), the
        lengths checked here. A step of a few requests then costs its
        lengths' check and one compiled call: none of find_batch's tests of
        the batch."""
        if self.one_runner(index) is None:
            return None
        return self._run_many or self._make_batch_runner()

    def _make_batch_runner(
        self,
    ) -> Callable[[tuple, Any, np.ndarray, int], np.ndarray]:
        sn, prep = self._prep_cache or self._prep()
        _same_modes(sn)
        hits = sn.scan_prepared_hits
        lengths = host_lengths
        backend = self  # its parallel setting read at call time

        def run(host: tuple, max_lengths: Any, table: Any, mode: int) -> np.ndarray:
            rows, starts, counts = host
            m = lengths(max_lengths, _LENGTHS_NAME[mode], starts.shape[0])
            return hits(prep, rows, starts, counts, m, table, mode, backend.parallel)

        self._run_many = run
        return run

    def lists_runner(
        self, index: KeyIndex
    ) -> Callable[[list, Any, np.ndarray, int, int], list[int] | None] | None:
        """See ``BatchBackend.lists_runner``: where :meth:`one_runner` has a
        runner, ``run(requests, lengths, table, mode, block_size)`` taking a
        list of requests msgspec writes as ints and lengths as a list of
        Python ints (its items exactly ``int``: what ``host_lengths`` takes
        of them, nothing msgspec would write by value) or a 1-D integer numpy
        array; the step as msgpack, read and scanned in one compiled call
        (``kernels/scan_numba_lists.py``). None for anything else, and for a
        step the launcher could spread over threads (``scan_numba.threaded``
        of its keys). Until the runner is made (:meth:`warm_up` makes it),
        a stand-in that makes it on its first call, so that an engine built
        with ``warm=False`` loads its program only once a step asks for it."""
        if self.one_runner(index) is None:
            return None
        run = self._run_lists
        if run is None:
            return self._lazy_lists
        return run or None

    def _lazy_lists(
        self, requests: list, lengths: Any, table: Any, mode: int, block_size: int
    ) -> list[int] | None:
        run = self._run_lists
        if run is None:
            run = self._make_lists_runner()
        return run(requests, lengths, table, mode, block_size) if run else None

    def _make_lists_runner(self) -> Callable[..., list[int] | None] | bool:
        sn, prep = self._prep_cache or self._prep()
        _same_modes(sn)
        from kvhit.kernels import scan_numba_lists

        # The kernel, the msgpack decoder it reads with, and the encoder.
        scan_numba_lists.warm_up(prep.one)
        if not decoder_ready():
            self._run_lists = False
            return False
        entry, one_hit = scan_numba_lists.lists_entry(), scan_numba_lists.ONE
        plan = prep.one
        threaded, empty = sn.threaded, np.empty
        backend = self  # its parallel setting read at call time

        def run(
            requests: list, lengths: Any, table: Any, mode: int, block_size: int
        ) -> list[int] | None:
            # Lists of ints and lengths as one message, or None for any
            # other form (encode_step's rules).
            msg = encode_step(requests, lengths)
            if msg is None:
                return None
            b = len(requests)
            if b == 0:
                # No request (the kernel reads a hit of no item as one): the
                # message of [[]] alone is a step of none with no lengths.
                return [] if msg == b"\x91\x90" else None
            parallel = backend.parallel
            # len(msg) bounds the keys (an int takes a byte at least), and
            # threads only come with more keys: the count only near them.
            # One request is threaded only when forced (threaded()'s rule).
            if (
                (b > 1 or parallel)
                and threaded(b, len(msg), parallel)
                and threaded(b, sum(map(len, requests)), parallel)
            ):
                return None
            # prefetching(b, table), spelled out (read at call time).
            pf = (
                b >= sn.PREFETCH_MIN_REQUESTS
                and table.nbytes >= sn.PREFETCH_MIN_TABLE_BYTES
            )
            if b == 1:
                # The hit returned: no array made or read.
                h = entry(msg, table, plan, 2 * mode + pf, block_size, one_hit)
                return None if h < 0 else [h]
            hit = empty(b, _INT64)
            if entry(msg, table, plan, 2 * mode + pf, block_size, hit) < 0:
                return None
            return hit.tolist()

        self._run_lists = run
        return run

    def find_batch(
        self,
        batch: HashBatch,
        max_lengths: np.ndarray | int,
        index: KeyIndex,
        apply_eagle: bool,
        spans: bool = True,
    ) -> tuple[np.ndarray | int, torch.Tensor | None]:
        """See ``BatchBackend.find_batch``: ``max_lengths`` from
        :meth:`lengths`, ``index`` not None; the hits as int64 numpy ``[B]``
        (an int for one request when no spans are asked for); no spans
        tensor unless ``spans``."""
        sn, prep = self._prep_cache or self._prep()
        mode = sn.FIND_EAGLE if apply_eagle else sn.FIND
        if not spans:
            rows = batch.host_single()
            if rows is not None:
                # A step of one request: one compiled call, its hit an int.
                if type(max_lengths) is not int:
                    max_lengths = max_lengths.item(0)
                hit = sn.scan_one(
                    prep, rows, max_lengths, self._host_table(index), mode
                )
                return hit, None
        rows, starts, lengths = batch.host_arrays()
        if not starts.shape[0]:
            return (
                np.zeros(0, dtype=np.int64),
                torch.zeros(0, self.plan.num_groups, 3, dtype=torch.int64),
            )
        if not spans:
            # The hits alone: one compiled call making its own scratch.
            hit = sn.scan_prepared_hits(
                prep, rows, starts, lengths, self._length_array(max_lengths),
                self._host_table(index), mode, self.parallel,
            )  # fmt: skip
            return hit, None
        hit, mask_spans = sn.scan_prepared(
            prep, rows, starts, lengths, self._length_array(max_lengths),
            self._host_table(index), mode, self.parallel,
        )  # fmt: skip
        return hit, torch.from_numpy(mask_spans)

    @staticmethod
    def _length_array(lengths: np.ndarray | int) -> np.ndarray:
        # One request's int from lengths() as the batch launcher reads it.
        if type(lengths) is int:
            return np.array((lengths,), dtype=np.int64)
        return lengths

    def lookup_batch(
        self, batch: HashBatch, num_tokens: np.ndarray | int, index: KeyIndex
    ) -> torch.Tensor:
        """See ``BatchBackend.lookup_batch``: ``num_tokens`` from
        :meth:`lengths`."""
        sn, prep = self._prep_cache or self._prep()
        rows = batch.host_single()
        if rows is not None:
            if type(num_tokens) is not int:
                num_tokens = num_tokens.item(0)
            hit = sn.scan_one(
                prep, rows, num_tokens, self._host_table(index), sn.LOOKUP
            )
            return torch.from_numpy(np.array((hit,), dtype=np.int64))
        rows, starts, lengths = batch.host_arrays()
        if not starts.shape[0]:
            return torch.zeros(0, dtype=torch.int64)
        hit = sn.scan_prepared_hits(
            prep, rows, starts, lengths, self._length_array(num_tokens),
            self._host_table(index), sn.LOOKUP, self.parallel,
        )  # fmt: skip
        return torch.from_numpy(hit)

    # -- the Backend protocol (views) -----------------------------------------

    def find(
        self,
        view: RaggedView,
        max_lengths: torch.Tensor,
        index: KeyIndex | None,
        apply_eagle: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``Backend.find``: ``(hit int64 [R], mask_spans int64 [R, G, 3])``."""
        if index is not None and view.token_lens is None:
            # The common case on the prepared launcher: the view's arrays are
            # kvhit's own (int64; contiguous once through _c).
            sn, prep = self._prep()
            hit, mask_spans = sn.scan_prepared(
                prep, _c(view.rows), _c(view.offsets), _c(view.lengths),
                _c(max_lengths), _c(_table(index)),
                sn.FIND_EAGLE if apply_eagle else sn.FIND, self.parallel,
            )  # fmt: skip
            return torch.from_numpy(hit), torch.from_numpy(mask_spans)
        from kvhit.kernels.scan_numba import find_hits

        hit, mask_spans = find_hits(
            _np(view.rows),
            _np(view.offsets),
            _np(view.lengths),
            _np(max_lengths),
            self._sg,
            self._cand,
            table=None if index is None else _table(index),
            token_lens=None if view.token_lens is None else _np(view.token_lens),
            params=self._params,
            apply_eagle=apply_eagle,
            parallel=self.parallel,
        )
        return torch.from_numpy(hit), torch.from_numpy(mask_spans)

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """See ``Backend.lookup``: int64 ``[R]`` tokens to load."""
        sn, prep = self._prep()
        out, _ = sn.scan_prepared(
            prep, _c(view.rows), _c(view.offsets), _c(view.lengths),
            _c(num_tokens), _c(_table(index)), sn.LOOKUP, self.parallel,
        )  # fmt: skip
        return torch.from_numpy(out)
