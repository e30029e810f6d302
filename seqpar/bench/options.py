"""Option helpers shared by the benchmark scripts (bench/*.py): comma-separated sweeps and the defaults
that ``--quick`` (the CPU smoke test) swaps in for the options a user did not give."""
from __future__ import annotations

import argparse
import math
from typing import Callable, Dict, List


def positive(value: float) -> bool:
    return value > 0


#: What :func:`probability` takes, for the option errors.
PROBABILITY_RANGE = "[0, 0.998046875)"


def probability(value: float) -> bool:
    """A dropout probability seqpar takes: in [0, 1) with round(p * 256) < 256, i.e. p < 0.998046875
    (:func:`seqpar.random.dropout_threshold`; NaN is not)."""
    from ..random import dropout_threshold   # imports torch: only once an option is checked

    try:
        dropout_threshold(value)
    except ValueError:
        return False
    return True


def comma_list(parser: argparse.ArgumentParser, option: str, text: str, convert: Callable = int,
               check: Callable[[float], bool] = positive, what: str = "positive integers") -> List:
    """The values of ``--option a,b,c``; anything ``convert`` can't read, a value ``check`` refuses (inf
    and NaN are refused for floats too) or an empty list is a usage error naming the option and its text
    (``parser.error``: one line, status 2), not a traceback in the middle of a sweep."""
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = None
    if not values or not all(math.isfinite(v) and check(v) for v in values):
        parser.error(f"{option} must be comma-separated {what}, got {text!r}")
    return values


def fill_defaults(args: argparse.Namespace, defaults: Dict[str, object], quick_defaults: Dict[str, object]) -> None:
    """Set each option of ``defaults`` the user left unset (None) to its default, or under ``--quick`` (the
    CPU smoke test: ``args.quick``) to its tiny one in ``quick_defaults``. Options given on the command
    line are kept either way: ``--quick --seqlens 64`` sweeps s = 64."""
    for key, default in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick_defaults.get(key, default) if args.quick else default)
