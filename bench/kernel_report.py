#!/usr/bin/env python3
"""Static kernel report for sm_90a (H100 / H200), runnable without a GPU.

Compiles the kernels for sm_90a and prints, per kernel and configuration: registers per thread, spill
bytes (ptxas ``-v``: spill stores + spill loads), the SASS instruction count of the main loop with
dropout off and on, and for the LayerNorm and dropout kernels the integer instructions per element
spent on the dropout mask.

Usage::

    python bench/kernel_report.py                       # print the report (about 20 min on 2 cores)
    python bench/kernel_report.py --json PATH --text PATH
    python bench/kernel_report.py --quick               # one or two sizes per kernel family, bf16 only (a smoke run)

What is compiled
    Triton (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, i.e. sm_90a, with Triton's bundled
    ptxas; no driver is touched). The launchers in ``triton_kernels/`` are called on CPU tensors laid
    out like the layer's (q, k, v as views of the fused [s, b, 3h] QKV; [s*b, h] rows) with their
    kernels replaced by recorders, so the report compiles exactly the arguments, constexprs and launch
    options a real launch would, specialised by Triton's own runtime binder (pointer alignment, int
    divisibility). For the autotuned attention kernels every configuration of the autotune list that
    the kernel's prune function keeps is compiled (s = 2048: every tile is even):

    - attention forward, dq, dk/dv: d in {64, 128}, bf16 and fp16, causal, dropout off and on, with
      k, v at q's heads (G = 1) and grouped-query (G = 4 q heads per kv head; every G > 1 compiles alike);
    - bias-dropout-add + LayerNorm forward and backward: the launch configuration (BLOCK_M, BLOCK_N,
      num_warps, and the column chunks "cN" of a row) of h in {1024, 4096, 8192, 12288, 16384, 20480,
      25600} (20480 and 25600: the paper's 530B and 1T models, column-chunked rows) with 8192 rows (the
      backward's program count assumes 132 SMs), bf16 and fp16, dropout off and on;
    - residual add + RMSNorm forward and backward, h in {1024, 4096, 8192, 16384}, and SwiGLU forward
      and backward, n in {11008, 14336}: the launch configuration on 8192 rows, bf16 and fp16;
    - dropout (triton_kernels/dropout.py; its backward is the same kernel on the gradient), h in {1024,
      4096, 12288}: the launch configuration on 8192 rows, bf16 and fp16 (dropout is always on).

    CUDA: each csrc/*.cu with ``nvcc -cubin -arch=sm_90a -O3 -lineinfo -Xptxas -v`` (the flags of the
    CMake build); every kernel instantiation for fp16 and bf16 (and the dtype-free ones) is reported:
    the launchers pick among exactly these. Dropout is a runtime flag of the CUDA kernels (one binary
    serves both), so their table has one instruction count per kernel.

How the main loop is found and counted
    ``nvdisasm -c -gi`` disassembles the cubin with inlined line information. A loop is a backward
    branch (a BRA to a label at a lower address); its body is every instruction from the label to the
    branch. Loops are merged when their ranges overlap, and a loop inside another counts as part of it.
    The count is static: every instruction of the range once, per thread (that is, per warp issue),
    whichever side of an if inside the loop runs. The main loop is

    - attention forward, dq, dk/dv: the innermost loop whose instructions are, by majority, inlined at a
      call of the kernel's inner-loop function (``_fwd_inner``, ``_bwd_dq_inner``, ``_bwd_dkdv_inner``)
      whose MASK argument is ``False`` (found in the kernel's Python AST): the key or query blocks that
      need no bound or causal mask, i.e. the bulk of the work (under GQA the dk/dv kernel's loop over
      the q heads of a kv head encloses it). Where the line info records no inline call sites (Triton
      3.6, the GPU image's), the innermost loop that runs the inner function's code and none of its
      ``if MASK:`` branches, the same loop;
    - kernels without a loop (the LayerNorm forwards: a row is one unrolled pass; the Triton dropout
      kernel: one tile): the whole kernel;
    - the other kernels: the largest top-level loop (the row loop of the LayerNorm backward, the
      column loop of dropout and softmax-dropout; for the softmax-dropout kernels, the loop that
      holds the mask code).

Mask cost
    Mask instructions are those whose inline chain passes through the mask code: Triton's
    ``triton/language/random.py`` (tl.rand, tl.philox), ``triton_kernels/philox.py`` and
    ``csrc/philox.cuh``. Integer instructions are the integer, logic, shift, move, select and
    predicate opcodes (IMAD*, IADD3, LOP3, SHF, LEA, PRMT, SEL, MOV, ISETP, IABS, IMNMX, VIADD*,
    BMSK, BFE, BFI, P2R, R2P, PLOP3, ...; their uniform U* forms; I2F conversions). Integer
    instructions per element = the mask's integer instructions in the counted region (the main loop or
    the whole kernel; or the innermost loop inside it that holds mask code, where the mask has its own
    loop, as the v1 kernels' per-element Philox loops did) divided by the mask elements one thread
    covers in one pass of that region (Triton tiles: BLOCK_M * BLOCK_N / threads; CUDA: the columns a
    thread owns per row or per loop iteration). ``Δint/elem`` (Triton) is the same region's integer-
    instruction count with dropout on minus off, per element: it includes applying the mask, not only
    drawing it.

Results
    bench/results/kernel_report.{txt,json} (committed with the commit and date they measured);
    bench/results/kernel_report.before.* hold the numbers of the v1 mask (one Philox-4x32-10 call per
    element, commit 24eac00), measured by the first version of this script.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import datetime
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # the report uses Triton's default

ARCH = "sm_90a"
SMS = 132  # H100 SXM; only the LayerNorm backward's program count depends on it
MASK_FILES = ("triton/language/random.py", "triton_kernels/philox.py", "csrc/philox.cuh")
ATTN_HEAD_DIMS = (64, 128)
ATTN_GROUPS = (1, 4)  # q heads per kv head: 1 = multi-head attention, 4 = grouped-query (Llama-3 8B)
LN_HIDDEN = (1024, 4096, 6144, 8192, 12288, 16384, 20480, 25600)
LN_ROWS = 8192
RMS_HIDDEN = (1024, 4096, 8192, 16384)   # Llama hidden sizes; 8192 and 16384 take the chunked backward
SWIGLU_N = (11008, 14336)                # Llama-2 7B and Llama-3 8B intermediate sizes
DROPOUT_HIDDEN = (1024, 4096, 12288)     # the Triton dropout kernel's column blocks: whole rows, then 1024
SEQ, BATCH, HEADS_X_D = 2048, 2, 2048
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DROPOUT_THRESHOLD = 26  # P = round(0.1 * 256): the launchers take the byte threshold

# Integer-class SASS opcodes (the base name before the first '.'; U-prefixed uniform forms too).
_INT_OPS = {"IMAD", "IADD3", "IADD", "IMUL", "IABS", "IMNMX", "VIMNMX", "VIMNMX3", "ISETP", "ICMP", "LOP3", "LOP",
            "SHF", "SHL", "SHR", "LEA", "PRMT", "SEL", "MOV", "MOV32I", "BMSK", "BFE", "BFI", "BREV", "FLO", "POPC",
            "VIADD", "VIADDMNMX", "IDP", "P2R", "R2P", "PLOP3", "I2F", "I2FP", "F2I", "I2I", "IMNMX3", "VABSDIFF",
            "VABSDIFF4", "IADD32I", "IMAD32I", "LOP32I", "ISCADD", "IMADSP"}


# ============================================================================= tools
def _triton_tool(name: str) -> str:
    from triton import knobs

    path = getattr(knobs.nvidia, name).path
    if path and os.path.exists(path):
        return path
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"kernel_report: {name} not found (Triton's bundled copy or PATH)")
    return found


def _run(cmd: Sequence[str], cwd: Optional[str] = None) -> str:
    proc = subprocess.run(list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc.stdout


# ============================================================================= SASS parsing
@dataclass
class Instr:
    text: str
    opcode: str                          # base opcode, predicate stripped ("IMAD" for "@!P0 IMAD.WIDE.U32 ...")
    chain: Tuple[Tuple[str, int], ...]   # inline chain, innermost frame first, the kernel's own line last


@dataclass
class Function:
    name: str
    instrs: List[Instr]
    spans: List[Tuple[int, int]]   # every backward branch: (label index, branch index), nested ones too
    loops: List[Tuple[int, int]]   # the top-level loops: overlapping spans merged


_ADDR_RE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_FILE_RE = re.compile(r'//## File "([^"]+)", line (\d+)')
_LABEL_RE = re.compile(r"^\s*(\.L_x_\d+):")
_BRA_RE = re.compile(r"\bBRA(?:\.\w+)*\s+`?\(?(\.L_x_\d+)")
_FUNC_RE = re.compile(r"^\s*\.text\.(\S+?):\s*$")


def _opcode(text: str) -> str:
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def _merge(spans: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    merged: List[List[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def parse_sass(cubin: bytes) -> Dict[str, Function]:
    """Functions of a cubin (``nvdisasm -c -gi``): instructions with inline chains, and loops."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = _run([_triton_tool("nvdisasm"), "-c", "-gi", path])
    finally:
        os.remove(path)
    functions: Dict[str, Function] = {}
    state = None  # (name, instrs, labels, branches)
    block: List[Tuple[str, int]] = []
    chain: Tuple[Tuple[str, int], ...] = ()

    def close():
        if state is not None:
            name, instrs, labels, branches = state
            # (A branch to itself is the trap loop after the kernel's EXIT, not a loop of the kernel.)
            spans = [(labels[t], i) for i, t in branches if t in labels and labels[t] < i]
            functions[name] = Function(name, instrs, spans, _merge(spans))

    for line in text.splitlines():
        m = _FUNC_RE.match(line)
        if m:
            close()
            state, block, chain = (m.group(1), [], {}, []), [], ()
            continue
        if state is None:
            continue
        name, instrs, labels, branches = state
        m = _FILE_RE.search(line)
        if m:
            # A block of "//## File" lines names the next instructions' location: innermost frame first,
            # then the frames it is inlined into, the last line being the kernel's own source line.
            block.append((m.group(1), int(m.group(2))))
            continue
        m = _LABEL_RE.match(line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = _ADDR_RE.search(line)
        if m:
            if block:
                chain, block = tuple(block), []
            body = m.group(1)
            b = _BRA_RE.search(body)
            if b:
                branches.append((len(instrs), b.group(1)))
            instrs.append(Instr(body, _opcode(body), chain))
    close()
    return functions


def is_int(op: str) -> bool:
    return op in _INT_OPS or (op.startswith("U") and op[1:] in _INT_OPS)


def is_mask(ins: Instr) -> bool:
    return any(f.endswith(m) for f, _ in ins.chain for m in MASK_FILES)


@dataclass
class RegionStats:
    counted: str                 # "main loop" or "whole kernel"
    instructions: int            # in the main loop (or the whole kernel)
    int_instructions: int
    mask_region: str             # where the mask is drawn: "main loop", "inner loop" or "whole kernel"
    mask_region_int: int         # integer instructions in that region
    mask_int: int                # ... of which mask code


def region_stats(fn: Function, span: Optional[Tuple[int, int]]) -> RegionStats:
    lo, hi = span if span is not None else (0, len(fn.instrs) - 1)
    body = fn.instrs[lo:hi + 1]
    # The innermost loop inside the region that holds mask code, if the mask is drawn in its own loop.
    inner = [(a, b) for a, b in fn.spans if lo <= a and b <= hi and (a, b) != (lo, hi)
             and any(is_mask(i) for i in fn.instrs[a:b + 1])]
    where = "main loop" if span is not None else "whole kernel"
    if inner:
        lo, hi = min(inner, key=lambda s: s[1] - s[0])
        where = "inner loop"
    region = fn.instrs[lo:hi + 1]
    return RegionStats("main loop" if span is not None else "whole kernel", len(body), sum(is_int(i.opcode) for i in body), where,
                       sum(is_int(i.opcode) for i in region), sum(is_int(i.opcode) and is_mask(i) for i in region))


def loop_by_call(fn: Function, call_lines: Sequence[int], source_file: str) -> Optional[Tuple[int, int]]:
    """The innermost loop most of whose instructions sit (inlined) at one of ``call_lines`` (the one with
    the most such instructions if several): nested loops count, so a loop enclosing the call's loop (the
    GQA head loop of dk/dv) is not taken for it."""
    def votes(span):
        lo, hi = span
        return sum(1 for ins in fn.instrs[lo:hi + 1]
                   if ins.chain and ins.chain[-1][0].endswith(source_file) and ins.chain[-1][1] in call_lines)

    majority = [s for s in set(fn.spans) | set(fn.loops) if votes(s) * 2 > s[1] - s[0] + 1]
    innermost = [s for s in majority if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in majority)]
    return max(innermost, key=votes) if innermost else None


def loop_by_lines(fn: Function, inner_lines: Sequence[int], masked_lines: Sequence[int],
                  source_file: str) -> Optional[Tuple[int, int]]:
    """The same loop as :func:`loop_by_call`, for line info that records no inline call sites (Triton
    3.6's: each instruction carries its innermost line only): the innermost loop that runs code of the
    inner-loop function (``inner_lines``) and none of its masked branch (``masked_lines``, the bodies of
    its ``if MASK:``), i.e. the loop of an unmasked call; the one with the most such code if several."""
    def count(span, lines):
        lo, hi = span
        return sum(1 for ins in fn.instrs[lo:hi + 1]
                   if ins.chain and ins.chain[0][0].endswith(source_file) and ins.chain[0][1] in lines)

    unmasked = [s for s in set(fn.spans) | set(fn.loops)
                if count(s, inner_lines) and not count(s, masked_lines)]
    innermost = [s for s in unmasked if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in unmasked)]
    return max(innermost, key=lambda s: count(s, inner_lines)) if innermost else None


def largest_loop(fn: Function, with_mask: bool = False) -> Optional[Tuple[int, int]]:
    loops = [s for s in fn.loops if not with_mask or any(is_mask(i) for i in fn.instrs[s[0]:s[1] + 1])]
    return max(loops, key=lambda s: s[1] - s[0]) if loops else None


def _source_tree(jit_fn) -> Tuple[ast.AST, int, int]:
    """(the AST of the @triton.jit function ``jit_fn``, its first source line, its number of lines)."""
    src_lines, first = inspect.getsourcelines(jit_fn.fn)
    return ast.parse(textwrap.dedent("".join(src_lines))), first, len(src_lines)


def unmasked_call_lines(kernel_fn, inner_name: str, inner_fn) -> List[int]:
    """Source lines of the calls ``inner_name(...)`` in ``kernel_fn`` whose MASK argument is ``False``."""
    mask_index = inner_fn.arg_names.index("MASK")
    tree, first, _ = _source_tree(kernel_fn)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == inner_name:
            arg = node.args[mask_index] if len(node.args) > mask_index else None
            arg = next((kw.value for kw in node.keywords if kw.arg == "MASK"), arg)
            if isinstance(arg, ast.Constant) and arg.value is False:
                lines.append(first + node.lineno - 1)
    return lines


def function_lines(jit_fn) -> Tuple[range, List[int]]:
    """(every source line of the @triton.jit function ``jit_fn``, the lines of the bodies of its
    ``if MASK:`` statements)."""
    tree, first, count = _source_tree(jit_fn)
    masked = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "MASK":
            for stmt in node.body:
                masked += range(first + stmt.lineno - 1, first + stmt.end_lineno)
    return range(first, first + count), masked


# ============================================================================= ptxas -v logs
@dataclass
class Resources:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


def parse_ptxas_log(log: str) -> Dict[str, Resources]:
    """{function (mangled) name: Resources} from ``ptxas -v`` output."""
    out: Dict[str, Resources] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line) or re.search(r"Function properties for (\S+)", line)
        if m:
            current = m.group(1)
            out.setdefault(current, Resources())
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[current].spill_stores, out[current].spill_loads = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current].registers = int(m.group(1))
    return out


# ============================================================================= Triton
@dataclass
class Launch:
    fn: object                                   # the JITFunction
    configs: List[dict] = field(default_factory=list)  # full kwargs (constexprs + options) per config
    args: tuple = ()


class _Recorder:
    """Stands in for a kernel (JITFunction, Heuristics or Autotuner) and records ``kernel[grid](...)``:
    the arguments, and per configuration the autotuner would try (after its prune function), the
    keyword arguments with the heuristics applied."""

    def __init__(self, kernel, sink: List[Launch]):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append(self._launch(args, kwargs))

    def _launch(self, args, kwargs) -> Launch:
        import triton

        k, configs, heuristics = self.kernel, [{}], {}
        if isinstance(k, triton.runtime.Autotuner):
            configs = k.configs
            if k.early_config_prune is not None:
                configs = k.early_config_prune(configs, dict(zip(k.arg_names, args)), **kwargs)
            configs = [dict(c.all_kwargs()) for c in configs]
            k = k.fn
        if isinstance(k, triton.runtime.Heuristics):
            heuristics, k = k.values, k.fn
        launch = Launch(k, [], args)
        for cfg in configs:
            kw = dict(kwargs, **cfg)
            named = dict(zip(k.arg_names, args), **kw)
            kw.update({key: fn(named) for key, fn in heuristics.items()})
            launch.configs.append(kw)
        return launch


@contextlib.contextmanager
def _patched(obj, **attrs):
    saved = {n: getattr(obj, n) for n in attrs}
    try:
        for n, v in attrs.items():
            setattr(obj, n, v)
        yield
    finally:
        for n, v in saved.items():
            setattr(obj, n, v)


def compile_triton(fn, args, kwargs) -> Tuple[bytes, Resources, str]:
    """Compile one launch for sm_90a like the runtime would: -> (cubin, ptxas resources, kernel name)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        knobs.nvidia.dump_ptxas_log = True       # Triton's make_cubin prints its ptxas -v log
        knobs.compilation.always_compile = True  # (a cache hit would skip ptxas and the log)
        kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=target, options=options.__dict__)
    return kernel.asm["cubin"], parse_ptxas_log(log.getvalue()).get(kernel.name, Resources()), kernel.name


def attention_launches(d: int, dtype: torch.dtype, dropout: bool, group: int = 1) -> Dict[str, Launch]:
    """The launches of attention_fwd + attention_bwd on the layer's layout: q, k, v views of one fused
    [s, b, (H + 2 H / group) d] projection (H = HEADS_X_D / d q heads, H / group kv heads)."""
    from seqpar.triton_kernels import attention as A

    heads, kv_heads = HEADS_X_D // d, HEADS_X_D // d // group
    qkv = torch.empty(SEQ, BATCH, (heads + 2 * kv_heads) * d, dtype=dtype)
    q, k, v = (t.view(SEQ, BATCH, -1, d).permute(1, 2, 0, 3)
               for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    p = DROPOUT_THRESHOLD if dropout else 0
    sink: List[Launch] = []

    def every_config(which, even_kernel, tuned_kernel, grid_rows, bh, args, meta, config, bucket=()):
        """A._launch recording the autotuned kernel's launch (every config it would try), whatever a
        length bucket tuned before (A._BUCKET_CONFIGS) or the interpreter's fixed tile."""
        tuned_kernel[None](*args, **meta)

    with _patched(A, _launch=every_config,
                  **{n: _Recorder(getattr(A, n), sink) for n in ("_fwd_tuned", "_dq_tuned", "_dkdv_tuned")}):
        o, lse = A.attention_fwd(q, k, v, True, d ** -0.5, p, 12345, 0)
        A.attention_bwd(torch.empty_like(o), q, k, v, o, lse, True, d ** -0.5, p, 12345, 0)
    return dict(zip(("fwd", "dq", "dkdv"), sink))


@contextlib.contextmanager
def _row_launch_policy(reduce_sink: List[Launch]):
    """The row kernels' launchers pick their GPU launch policy on CPU tensors: SMS SMs on device 0, and
    the column reduction of a backward recorded into ``reduce_sink`` instead of run."""
    from seqpar.triton_kernels import rows as R

    with _patched(R, sm_count=lambda index: SMS,
                  _reduce_partials_kernel=_Recorder(R._reduce_partials_kernel, reduce_sink)), \
            _patched(torch.cuda, current_device=lambda: 0):
        yield


# The row kernels' launches by kernel name: forward, the backward's row-sum pass (rows wider than one
# backward program's columns), the backward, its column reduction.
ROW_KERNELS = {"_fwd_kernel": "fwd", "_bwd_row_sums_kernel": "rowsums", "_bwd_kernel": "bwd",
              "_reduce_partials_kernel": "reduce"}


def ln_launches(h: int, dtype: torch.dtype, dropout: bool) -> Dict[str, Launch]:
    """The launches of the LayerNorm forward + backward on [LN_ROWS, h] rows, as on a GPU with SMS SMs."""
    from seqpar.triton_kernels import bias_dropout_add_layer_norm as L

    x, w = torch.empty(LN_ROWS, h, dtype=dtype), torch.empty(h, dtype=dtype)
    stats = torch.empty(LN_ROWS)
    p = DROPOUT_THRESHOLD if dropout else 0
    sink: List[Launch] = []
    with _patched(L, **{n: _Recorder(getattr(L, n), sink) for n in ROW_KERNELS if hasattr(L, n)}), \
            _row_launch_policy(sink):
        L.forward(x, w, x, w, w, 1e-5, p, 12345, 0)
        L.backward(x, x, x, w, stats, stats, p, 12345, 0, (True, True, True))
    return {ROW_KERNELS[launch.fn.__name__]: launch for launch in sink}


def llama_launches(op: str, dim: int, dtype: torch.dtype) -> Dict[str, Launch]:
    """The launches of the residual add + RMSNorm (h = dim) or SwiGLU (n = dim) forward + backward on
    LN_ROWS rows, as on a GPU with SMS SMs."""
    from seqpar.triton_kernels import rms_norm as M, swiglu as S

    sink: List[Launch] = []
    module = M if op == "rmsnorm" else S
    with _patched(module, **{n: _Recorder(getattr(module, n), sink) for n in ROW_KERNELS if hasattr(module, n)}), \
            _row_launch_policy([]):
        if op == "rmsnorm":
            x, w = torch.empty(LN_ROWS, dim, dtype=dtype), torch.empty(dim, dtype=dtype)
            M.forward(x, x, w, 1e-5)
            M.backward(x, x, x, w, torch.empty(LN_ROWS), True, True)
        else:
            gate_up, grad_y = torch.empty(LN_ROWS, 2 * dim, dtype=dtype), torch.empty(LN_ROWS, dim, dtype=dtype)
            S.forward(gate_up)
            S.backward(grad_y, gate_up)
    return {ROW_KERNELS[launch.fn.__name__]: launch for launch in sink}


def dropout_launches(h: int, dtype: torch.dtype) -> Dict[str, Launch]:
    """The launches of the Triton dropout kernel on [LN_ROWS, h] rows: plain ("fwd", the backward alike) and
    with a bias and a residual ("bda": bias_dropout_add's forward)."""
    from seqpar.triton_kernels import dropout as D

    sink: List[Launch] = []
    x = torch.empty(LN_ROWS, h, dtype=dtype)
    with _patched(D, _dropout_kernel=_Recorder(D._dropout_kernel, sink)):
        D.dropout_rows(x, 12345, 0, DROPOUT_THRESHOLD)
        D.dropout_rows(x, 12345, 0, DROPOUT_THRESHOLD, torch.empty(h, dtype=dtype), torch.empty_like(x))
    return {"fwd": sink[0], "bda": sink[1]}


def _triton_row(job) -> dict:
    """Compile and measure one Triton configuration (runs in a worker process)."""
    family, which, dim, dtype_name, dropout, index, *rest = job   # (..., index[, group]): attention's G
    group = rest[0] if rest else 1
    if family == "attention":
        launch = attention_launches(dim, DTYPES[dtype_name], dropout, group)[which]
    elif family == "ln":
        launch = ln_launches(dim, DTYPES[dtype_name], dropout)[which]
    elif family == "dropout":
        launch = dropout_launches(dim, DTYPES[dtype_name])[which]
    else:
        launch = llama_launches(family, dim, DTYPES[dtype_name])[which]
    kw = launch.configs[index]
    cubin, res, name = compile_triton(launch.fn, launch.args, kw)
    fn = parse_sass(cubin)[name]
    warps = kw.get("num_warps", 4)
    if family == "attention":
        from seqpar.triton_kernels import attention as A

        inner = {"fwd": "_fwd_inner", "dq": "_bwd_dq_inner", "dkdv": "_bwd_dkdv_inner"}[which]
        source = "triton_kernels/attention.py"
        span = (loop_by_call(fn, unmasked_call_lines(launch.fn, inner, getattr(A, inner)), source)
                or loop_by_lines(fn, *function_lines(getattr(A, inner)), source))
        if span is None:
            raise RuntimeError(f"{name}: no loop inlined at an unmasked {inner} call")
        config = f"{kw['BLOCK_M']}x{kw['BLOCK_N']} w{warps} s{kw.get('num_stages', 3)}"
    else:
        span = largest_loop(fn)
        config = "x".join(str(v) for k, v in sorted(kw.items()) if k.startswith("BLOCK_")) + f" w{warps}"
        if kw.get("CHUNKED") or kw.get("N_CHUNKS", 1) > 1:
            config += f" c{-(-dim // kw['BLOCK_N'])}"
    stats = region_stats(fn, span)
    elements = kw.get("BLOCK_M", kw.get("BLOCK_P", 1)) * kw.get("BLOCK_N", 1) / (32 * warps)
    return dict(backend="triton", family=family, kernel=which, dim=dim, dtype=dtype_name, dropout=dropout,
                group=group, config=config, registers=res.registers, spill_bytes=res.spill_stores + res.spill_loads,
                elements_per_thread=elements, **asdict(stats))


def triton_jobs(quick: bool) -> List[tuple]:
    jobs = []
    dtypes = ("bf16",) if quick else tuple(DTYPES)
    for group in ATTN_GROUPS:
        for d in (128,) if quick else ATTN_HEAD_DIMS:
            for dt in dtypes:
                for dropout in (False, True):
                    for which, launch in attention_launches(d, DTYPES[dt], dropout, group).items():
                        jobs += [("attention", which, d, dt, dropout, i, group) for i in range(len(launch.configs))]
    for h in (8192, 20480) if quick else LN_HIDDEN:
        for dt in dtypes:
            for dropout in (False, True):
                # the row-sum pass and the reduction do not depend on dropout: compiled once
                for which in ln_launches(h, DTYPES[dt], dropout):
                    if not dropout or which in ("fwd", "bwd"):
                        jobs.append(("ln", which, h, dt, dropout, 0))
    for family, dims in (("rmsnorm", RMS_HIDDEN), ("swiglu", SWIGLU_N)):
        for dim in dims[1:2] if quick else dims:
            jobs += [(family, which, dim, dt, False, 0)
                     for dt in dtypes for which in llama_launches(family, dim, DTYPES[dt])]
    for h in DROPOUT_HIDDEN[1:2] if quick else DROPOUT_HIDDEN:
        jobs += [("dropout", which, h, dt, True, 0) for dt in dtypes for which in ("fwd", "bda")]
    return jobs


# ============================================================================= CUDA
# Per kernel (demangled base name): how its main loop is chosen ("kernel": no loop, count the whole kernel;
# "largest": the largest top-level loop; "mask": the largest top-level loop holding mask code) and how many
# mask elements one thread covers in one pass of the region the mask is drawn in ((template arguments,
# region) -> count; region as in RegionStats.mask_region).
def _ln_elements(targs: List[str], region: str) -> int:
    vec, vpt = int(targs[1]), int(targs[2])          # <T, VEC, VPT, WARP>: VPT runs of VEC columns
    return vec * vpt


CUDA_KERNELS: Dict[str, Tuple[str, Callable[[List[str], str], int]]] = {
    "seqpar::dropout_rows_kernel": ("largest", lambda t, r: 16),      # a 16-column group per iteration
    "seqpar::bdaln::fwd_kernel": ("kernel", _ln_elements),
    "seqpar::bdaln::bwd_kernel": ("largest", _ln_elements),
    "seqpar::bdaln::bwd_row_sums_kernel": ("largest", lambda t, r: 4 * int(t[1])),  # <T, VEC>, unrolled 4x
    "seqpar::bdaln::bwd_columns_kernel": ("largest", lambda t, r: int(t[1])),       # one run per row
    "seqpar::rmsnorm::bwd_row_sums_kernel": ("largest", lambda t, r: 4 * int(t[1])),
    "seqpar::rmsnorm::bwd_columns_kernel": ("largest", lambda t, r: int(t[1])),
    "seqpar::rows::reduce_partials_kernel": ("largest", lambda t, r: 1),
    "seqpar::(anonymous namespace)::softmax_dropout_fwd_kernel": ("mask", lambda t, r: 16),
    "seqpar::(anonymous namespace)::softmax_dropout_bwd_kernel": ("mask", lambda t, r: 16),
}


def _demangle(names: Sequence[str]) -> Dict[str, str]:
    out = _run(["c++filt"] + list(names)) if shutil.which("c++filt") else "\n".join(names)
    return dict(zip(names, out.splitlines()))


_ROW_KINDS = ("warp", "block", "chunked")  # csrc/row_reduce.cuh's RowKind values


def _template_args(demangled: str) -> Tuple[str, List[str]]:
    """("ns::kernel", [template arguments]) of a demangled ``void ns::kernel<A, B>(params)``; a RowKind
    argument (``(seqpar::rows::RowKind)1``) reads as its name ("block")."""
    text = demangled.replace("(anonymous namespace)", "{anon}")
    text = re.sub(r"\((?:\w+::)*RowKind\)(\d)", lambda m: _ROW_KINDS[int(m.group(1))], text)
    text = text[5:] if text.startswith("void ") else text
    depth = 0
    for i, ch in enumerate(text):  # the parameter list: the first "(" outside the template arguments
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            text = text[:i]
            break
    if "<" not in text:
        return text.replace("{anon}", "(anonymous namespace)"), []
    base, inner = text[:text.index("<")], text[text.index("<") + 1:text.rindex(">")]
    args, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
            continue
        depth += (ch == "<") - (ch == ">")
        cur += ch
    args.append(cur.strip())
    return base.replace("{anon}", "(anonymous namespace)"), args


def _sort_key(demangled: str):
    base, targs = _template_args(demangled)
    return base, [(0, int(a), "") if a.lstrip("-").isdigit() else (1, 0, a) for a in targs]


def cuda_rows(quick: bool) -> List[dict]:
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        print("kernel_report: nvcc not found, CUDA kernels skipped", file=sys.stderr)
        return []
    csrc = os.path.join(ROOT, "csrc")
    rows = []
    for src in sorted(f for f in os.listdir(csrc) if f.endswith(".cu")):
        with tempfile.TemporaryDirectory() as tmp:
            cubin_path = os.path.join(tmp, "k.cubin")
            log = _run([nvcc, "-cubin", f"-arch={ARCH}", "-O3", "-DNDEBUG", "-std=c++17", "-lineinfo",
                        "--expt-relaxed-constexpr", "-Xptxas", "-v", "-I", csrc, "-o", cubin_path,
                        os.path.join(csrc, src)])
            with open(cubin_path, "rb") as f:
                cubin = f.read()
        resources = parse_ptxas_log(log)
        functions = parse_sass(cubin)
        names = _demangle(sorted(functions))
        for mangled, fn in sorted(functions.items(), key=lambda kv: _sort_key(names[kv[0]])):
            base, targs = _template_args(names[mangled])
            if targs and targs[0] == "float" or quick and targs and targs[0] != "__nv_bfloat16":
                continue  # fp16 and bf16 (and dtype-free kernels) only
            rule, elements = CUDA_KERNELS.get(base, ("largest", lambda t, r: 1))
            span = None if rule == "kernel" else largest_loop(fn, with_mask=rule == "mask")
            stats = region_stats(fn, span)
            res = resources.get(mangled, Resources())
            parts = base.split("::")   # the kernel and its namespace (several files have a fwd_kernel)
            name = "::".join(parts[-2:]) if len(parts) > 2 and not parts[-2].startswith("(") else parts[-1]
            label = name + (f"<{', '.join(targs)}>" if targs else "")
            rows.append(dict(backend="cuda", family=src, kernel=label,
                             registers=res.registers, spill_bytes=res.spill_stores + res.spill_loads,
                             elements_per_thread=elements(targs, stats.mask_region), **asdict(stats)))
    return rows


# ============================================================================= report
def _per_elem(row) -> Optional[float]:
    if row["mask_int"] == 0:
        return None
    return row["mask_int"] / row["elements_per_thread"]


def format_report(meta: dict, rows: List[dict]) -> str:
    kernel_order = list(ROW_KERNELS.values())
    out = [f"seqpar static kernel report for {meta['arch']}", "",
           f"commit {meta['commit']}  date {meta['date']}  triton {meta['triton']}  nvcc {meta['nvcc']}", ""]
    att = [r for r in rows if r["backend"] == "triton" and r["family"] == "attention"]
    if att:
        out += ["Triton attention (causal, s = 2048): main loop SASS instructions per thread, dropout off -> on",
                "(G: q heads per kv head; G = 4 is grouped-query attention; '-': the tile is not offered then)",
                f"{'kernel':6} {'d':>4} {'G':>2} {'dtype':5} {'config':16} {'regs off/on':>12} {'spill B off/on':>15} "
                f"{'loop off':>9} {'loop on':>8} {'ratio':>6} {'mask int/elem':>14}"]
        attn_key = lambda r: (r["kernel"], r["dim"], r.get("group", 1), r["dtype"], r["config"])  # noqa: E731
        for key in sorted({attn_key(r) for r in att},
                          key=lambda k: (["fwd", "dq", "dkdv"].index(k[0]), k[2], k[1], k[3], k[4])):
            off = next((r for r in att if attn_key(r) == key and not r["dropout"]), None)
            on = next((r for r in att if attn_key(r) == key and r["dropout"]), None)
            if off is None or on is None:  # a tile offered only without (or only with) dropout
                field = lambda r, k: "-" if r is None else r[k]  # noqa: E731
                out.append(f"{key[0]:6} {key[1]:>4} {key[2]:>2} {key[3]:5} {key[4]:16} "
                           f"{field(off, 'registers'):>5}/{field(on, 'registers'):<6} "
                           f"{field(off, 'spill_bytes'):>7}/{field(on, 'spill_bytes'):<7} "
                           f"{field(off, 'instructions'):>9} {field(on, 'instructions'):>8}")
                continue
            pe = _per_elem(on)
            out.append(f"{key[0]:6} {key[1]:>4} {key[2]:>2} {key[3]:5} {key[4]:16} "
                       f"{off['registers']:>5}/{on['registers']:<6} "
                       f"{off['spill_bytes']:>7}/{on['spill_bytes']:<7} {off['instructions']:>9} "
                       f"{on['instructions']:>8} {on['instructions'] / off['instructions']:>6.2f} "
                       f"{'' if pe is None else f'{pe:.2f}':>14}")
        out.append("")
    ln = [r for r in rows if r["backend"] == "triton" and r["family"] == "ln"]
    if ln:
        out += ["Triton bias-dropout-add + LayerNorm (8192 rows): region = row loop (bwd), chunk loop (rowsums), "
                "largest loop (reduce) or whole kernel (fwd)",
                f"{'kernel':6} {'h':>6} {'dtype':5} {'config':14} {'regs off/on':>12} {'spill B off/on':>15} "
                f"{'instr off':>9} {'instr on':>9} {'mask int/elem':>14} {'Δint/elem':>10}"]
        for key in sorted({(r["kernel"], r["dim"], r["dtype"]) for r in ln},
                          key=lambda k: (kernel_order.index(k[0]), k[1], k[2])):
            off = next(r for r in ln if (r["kernel"], r["dim"], r["dtype"]) == key and not r["dropout"])
            on = next((r for r in ln if (r["kernel"], r["dim"], r["dtype"]) == key and r["dropout"]), None)
            if on is None:
                out.append(f"{key[0]:6} {key[1]:>6} {key[2]:5} {off['config']:14} {off['registers']:>5}{'':7} "
                           f"{off['spill_bytes']:>7}{'':8} {off['instructions']:>9}")
                continue
            pe = _per_elem(on)
            delta = (on["int_instructions"] - off["int_instructions"]) / on["elements_per_thread"]
            out.append(f"{key[0]:6} {key[1]:>6} {key[2]:5} {on['config']:14} {off['registers']:>5}/{on['registers']:<6} "
                       f"{off['spill_bytes']:>7}/{on['spill_bytes']:<7} {off['instructions']:>9} {on['instructions']:>9} "
                       f"{'' if pe is None else f'{pe:.2f}':>14} {delta:>10.2f}")
        out.append("")
    llama = [r for r in rows if r["backend"] == "triton" and r["family"] in ("rmsnorm", "swiglu")]
    if llama:
        out += [f"Triton residual add + RMSNorm (h) and SwiGLU (n) ({LN_ROWS} rows): region = row loop (RMSNorm "
                "bwd) or whole kernel",
                f"{'op':8} {'kernel':6} {'h / n':>6} {'dtype':5} {'config':14} {'regs':>5} {'spill B':>8} {'instr':>6}"]
        for r in sorted(llama, key=lambda r: (r["family"], kernel_order.index(r["kernel"]), r["dim"], r["dtype"])):
            out.append(f"{r['family']:8} {r['kernel']:6} {r['dim']:>6} {r['dtype']:5} {r['config']:14} "
                       f"{r['registers']:>5} {r['spill_bytes']:>8} {r['instructions']:>6}")
        out.append("")
    drop = [r for r in rows if r["backend"] == "triton" and r["family"] == "dropout"]
    if drop:
        out += [f"Triton dropout ({LN_ROWS} rows; fwd: plain, the backward is the same kernel; bda: with a bias and "
                "a residual, bias_dropout_add's forward): whole kernel",
                f"{'kernel':6} {'h':>6} {'dtype':5} {'config':14} {'regs':>5} {'spill B':>8} {'instr':>6} "
                f"{'mask int/elem':>14}"]
        for r in sorted(drop, key=lambda r: (r["kernel"], r["dim"], r["dtype"])):
            pe = _per_elem(r)
            out.append(f"{r['kernel']:6} {r['dim']:>6} {r['dtype']:5} {r['config']:14} {r['registers']:>5} "
                       f"{r['spill_bytes']:>8} {r['instructions']:>6} {'' if pe is None else f'{pe:.2f}':>14}")
        out.append("")
    cu = [r for r in rows if r["backend"] == "cuda"]
    if cu:
        out += ["CUDA kernels (one binary per instantiation; dropout is a runtime flag): main loop or whole kernel",
                f"{'kernel':62} {'regs':>5} {'spill B':>8} {'counted':>8} {'instr':>6} {'mask drawn in':>13} "
                f"{'mask int/elem':>14}"]
        for r in cu:
            pe = _per_elem(r)
            counted = "kernel" if r["counted"] == "whole kernel" else "loop"
            out.append(f"{r['kernel'][:62]:62} {r['registers']:>5} {r['spill_bytes']:>8} {counted:>8} "
                       f"{r['instructions']:>6} {r['mask_region'] if pe is not None else '':>13} "
                       f"{'' if pe is None else f'{pe:.2f}':>14}")
        out.append("")
    return "\n".join(out)


def summarize(rows: List[dict]) -> Dict[str, object]:
    """Per kernel family: the largest main-loop ratio dropout on / off (attention), the spilling
    configurations, the largest mask cost in integer instructions per element."""
    out: Dict[str, object] = {}
    att = [r for r in rows if r["backend"] == "triton" and r["family"] == "attention"]
    for kernel in ("fwd", "dq", "dkdv"):
        ratios = []
        for on in (r for r in att if r["kernel"] == kernel and r["dropout"]):
            off = next((r for r in att if not r["dropout"] and all(r.get(k) == on.get(k) for k in
                                                                   ("kernel", "dim", "group", "dtype", "config"))),
                       None)
            if off is not None:
                ratios.append(on["instructions"] / off["instructions"])
        if ratios:
            out[f"attention_{kernel}_max_ratio"] = round(max(ratios), 3)
    out["spilling_configs"] = [f"{r['backend']} {r['family']} {r['kernel']} {r.get('dim', '')} {r.get('dtype', '')} "
                               f"{r.get('config', '')} G={r.get('group', '-')} dropout={r.get('dropout', '-')}: "
                               f"{r['spill_bytes']} B"
                               for r in rows if r["spill_bytes"]]
    for name, pick in (("triton_ln", lambda r: r["backend"] == "triton" and r["family"] == "ln"),
                       ("triton_dropout", lambda r: r["backend"] == "triton" and r["family"] == "dropout"),
                       ("cuda", lambda r: r["backend"] == "cuda")):
        costs = [_per_elem(r) for r in rows if pick(r) and _per_elem(r) is not None]
        if costs:
            out[f"{name}_max_mask_int_per_elem"] = round(max(costs), 2)
    return out


def _versions() -> Tuple[str, str]:
    import triton

    nvcc = shutil.which("nvcc")
    version = "none"
    if nvcc:
        m = re.search(r"release ([\d.]+)", _run([nvcc, "--version"]))
        version = m.group(1) if m else "?"
    return triton.__version__, version


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows and metadata as JSON to this path")
    parser.add_argument("--text", help="also write the printed report to this path")
    parser.add_argument("--quick", action="store_true", help="one or two sizes per kernel family, bf16 only")
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA kernels")
    parser.add_argument("--no-triton", action="store_true", help="skip the Triton kernels")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes")
    args = parser.parse_args(argv)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_report: run it without TRITON_INTERPRET=1 (it compiles for the GPU)")
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: JIT kernels, not interpreted ones

    from seqpar.bench.results import git_commit

    triton_version, nvcc_version = _versions()
    meta = dict(arch=ARCH, commit=git_commit(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                triton=triton_version, nvcc=nvcc_version)
    rows: List[dict] = []
    if not args.no_triton:
        jobs = triton_jobs(args.quick)
        print(f"compiling {len(jobs)} Triton configurations for {ARCH} ...", file=sys.stderr, flush=True)
        with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows += list(pool.map(_triton_row, jobs))
    if not args.no_cuda:
        print(f"compiling csrc/*.cu for {ARCH} ...", file=sys.stderr, flush=True)
        rows += cuda_rows(args.quick)
    summary = summarize(rows)
    text = format_report(meta, rows) + "\nSummary\n" + "\n".join(
        f"  {k}: {v if v != [] else 'none'}" for k, v in summary.items()) + "\n"
    print(text)
    if args.text:
        with open(args.text, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta, summary=summary, rows=rows), f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
