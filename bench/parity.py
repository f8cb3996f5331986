"""The parity check every measurement passes first: a backend's hits equal to
the reference loop's on every request up to a cap, on a random sample above
it (:class:`~kvhit.bench.names.MismatchError` naming the requests otherwise).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvhit.bench.names import MismatchError

__all__ = ["check_parity", "parity_indices"]


def parity_indices(batch_size: int, cap: int, sample: int, seed: int) -> list[int]:
    """Requests to check: all of them up to ``cap``, a random ``sample`` above."""
    if batch_size <= cap:
        return list(range(batch_size))
    rng = random.Random(seed)
    return sorted(rng.sample(range(batch_size), min(sample, batch_size)))


def check_parity(
    label: str,
    got: Sequence[int],
    want: Mapping[int, int],
    num_tokens: Sequence[int],
) -> None:
    """Raises :class:`MismatchError` naming the first few requests ``i`` with
    ``got[i] != want[i]``."""
    bad = [i for i, h in want.items() if int(got[i]) != h]
    if bad:
        shown = ", ".join(
            f"#{i} (num_tokens={num_tokens[i]}): {label}={int(got[i])} "
            f"reference={want[i]}"
            for i in bad[:5]
        )
        raise MismatchError(
            f"{label} disagrees with the reference on {len(bad)} of {len(want)} "
            f"checked requests: {shown}"
        )
