"""Design experiments of the benchmark scripts: seqpar-triton with one launch-time setting of a Triton kernel
module (``seqpar.triton_kernels.<module>.<setting>``, read at each launch) changed while the variant's calls
run, backward included. Its rows, beside seqpar-triton's on the same device, say whether the shipped value
belongs. A variant is named ``variant-*``, not ``seqpar-*``, so bench/gpu_summary.py's targets ignore it."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable, Iterator


@dataclasses.dataclass(frozen=True)
class DesignVariant:
    """``seqpar.triton_kernels.<module>.<setting>`` = ``value`` while the variant's calls run
    (:meth:`applied`), on the configurations ``runs_on`` accepts (:meth:`check`)."""
    module: str                        # under seqpar.triton_kernels
    setting: str
    value: int
    takes: str                         # what the variant runs instead of the shipped design
    where: str                         # the configurations it runs on (the skip message's words)
    runs_on: Callable[..., bool]       # runs_on(**configuration) -> whether it runs there

    def check(self, **configuration) -> None:
        """RuntimeError (a benchmark's "skipped") outside :attr:`where`."""
        if not self.runs_on(**configuration):
            raise RuntimeError(f"only for {self.where}")

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The setting at the variant's value inside the block, the shipped value restored after."""
        module = importlib.import_module(f"seqpar.triton_kernels.{self.module}")
        shipped = getattr(module, self.setting)
        setattr(module, self.setting, self.value)
        try:
            yield
        finally:
            setattr(module, self.setting, shipped)


def applied(variants: dict, provider: str):
    """The context a provider's calls run in: its variant applied, or nothing for any other provider."""
    return variants[provider].applied() if provider in variants else contextlib.nullcontext()


def print_bwd_ratios(variants: dict, results: dict, label: Callable[[tuple], str]) -> None:
    """After a sweep: each variant's backward GPU time over seqpar-triton's wherever both ran (``results``:
    configuration key -> provider -> times, 'bwd_gpu' among them; ``label(key)`` writes a key)."""
    for name, variant in variants.items():
        pairs = [(key, by[name], by["seqpar-triton"]) for key, by in results.items()
                 if name in by and "seqpar-triton" in by]
        if pairs:
            print(f"\nbwd GPU time, {name} / seqpar-triton (below 1: {variant.takes} beats the shipped design)")
            for key, mine, shipped in pairs:
                print(f"  {label(key)} {mine['bwd_gpu'] / shipped['bwd_gpu']:.2f}")
