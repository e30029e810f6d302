"""Command line: ``python -m seqpar info`` and ``python -m seqpar bench`` (also ``seqpar-bench``)."""
from __future__ import annotations

import argparse
import platform
import sys
from typing import List, Optional


def info() -> None:
    """Print versions, whether the CUDA extension is built (and why not), and the usable backends per op."""
    import torch

    import seqpar
    from seqpar import _ext
    from seqpar.ops import registry

    print(f"seqpar {seqpar.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton
        print(f"triton {triton.__version__}  (TRITON_INTERPRET={'1' if _ext.triton_interpreter_enabled() else '0'})")
    except Exception as exc:  # noqa: BLE001 - report, don't fail
        print(f"triton: not importable ({exc})")
    cuda = torch.cuda.is_available()
    print(f"CUDA device: {torch.cuda.get_device_name(0) if cuda else 'none'}")
    reason = _ext.cuda_extension_error()
    print("CUDA extension seqpar._C: " + ("built" if reason is None else f"not available: {reason}"))
    for device in ["cpu"] + (["cuda"] if cuda else []):
        print(f"backends on {device} (explicit backend=...):")
        for op, backends in registry.backend_report(torch.device(device)).items():
            cells = [f"{name}: {'usable' if why is None else 'no (' + why + ')'}" for name, why in backends.items()]
            print(f"  {op:<30} " + "; ".join(cells))


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m seqpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, CUDA extension status, usable backends per op")
    sub.add_parser("bench", help="the paper's five layer experiments (see python -m seqpar bench --help)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        info()
    else:
        from .bench.layer_bench import main as bench
        bench(rest)


def bench_main() -> None:
    """Entry point of the ``seqpar-bench`` console script."""
    from .bench.layer_bench import main as bench

    bench(sys.argv[1:])
