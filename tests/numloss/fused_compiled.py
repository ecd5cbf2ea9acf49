"""The fused pass's two Triton kernels compiled ahead of time for CUDA targets, with no GPU: triton's
compiler lowers them to PTX for sm_80 / sm_90 and the ptxas that ships with triton assembles them and says
how many registers and spill bytes each uses. Run as a script by tests/numloss/test_fused_pass.py in a
fresh process (TRITON_INTERPRET unset: the interpreter replaces the compiler in a process that set it).

Each kernel is compiled as triton's JIT specialises it at run time on the GPU: `BLOCK_V` and `num_warps`
as `numloss.fused_pass` launches them, and pointers, row strides and the width `V` marked divisible by 16
where they are (torch's allocations are; a row stride and V are when the chunk width is a multiple of 16,
which `numloss.chunked_head.chunk_columns` keeps). The report: per case the PTX target, the global load
and store widths in the kernel, registers and spill bytes.

    python tests/numloss/fused_compiled.py [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARCHS = (80, 90)
DTYPES = {"bf16": "bf16", "fp32": "fp32"}

# argument -> triton type, in each kernel's order; which arguments are divisible by 16 when rows are aligned
ROW_STATS = {"x_ptr": "*{dt}", "stride_x": "i64", "target_ptr": "*i64", "owns_ptr": "*i8", "max_ptr": "*fp32",
             "sum_ptr": "*fp32", "target_out_ptr": "*fp32", "V": "i32", "HAS_TARGET": "constexpr",
             "BLOCK_V": "constexpr"}
GRADIENT = {"x_ptr": "*{dt}", "stride_x": "i64", "out_ptr": "*{dt}", "stride_out": "i64", "lse_ptr": "*fp32",
            "grad_lse_ptr": "*fp32", "target_ptr": "*i64", "owns_ptr": "*i8", "grad_target_ptr": "*fp32", "V": "i32",
            "BLOCK_V": "constexpr"}
ALIGNED = {"x_ptr", "stride_x", "out_ptr", "stride_out", "V", "target_ptr", "owns_ptr", "max_ptr", "sum_ptr",
           "target_out_ptr", "lse_ptr", "grad_lse_ptr", "grad_target_ptr"}


def compile_case(kernel, signature: dict, constexprs: dict, arch: int, dtype: str, aligned: bool, work: Path) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from numloss.fused_pass import GPU_WARPS

    sig = {name: kind.format(dt=dtype) for name, kind in signature.items()}
    names = list(signature)
    divisible = ALIGNED if aligned else {n for n in ALIGNED if n.endswith("_ptr")}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in names}
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": GPU_WARPS})
    ptx = compiled.asm["ptx"]
    target = re.search(r"\.target (\w+)", ptx).group(1)
    path = work / f"{kernel.__name__}-{arch}-{dtype}-{aligned}.ptx"
    path.write_text(ptx)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    out = subprocess.run([str(ptxas), "-v", "--gpu-name", target, str(path), "-o", str(path.with_suffix(".cubin"))],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed on {path.name}: {out.stderr[-1000:]}")
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", out.stderr)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    spills += [int(n) for n in re.findall(r"(\d+) bytes spill loads", out.stderr)]
    return {"kernel": kernel.__name__, "arch": arch, "target": target, "dtype": dtype, "aligned": aligned,
            "block_v": constexprs["BLOCK_V"], "loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
            "stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx))), "registers": max(registers),
            "spill_bytes": sum(spills)}


def report() -> list[dict]:
    from numloss.fused_pass import GPU_BLOCK_V, _kernels

    row_stats, gradient = _kernels()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = str(Path(tmp) / "cache")  # nothing from another process's cache
        for arch in ARCHS:
            for dtype in DTYPES:
                for aligned in (True, False):
                    rows.append(compile_case(row_stats, ROW_STATS, {"HAS_TARGET": True, "BLOCK_V": GPU_BLOCK_V},
                                             arch, dtype, aligned, Path(tmp)))
                    rows.append(compile_case(gradient, GRADIENT, {"BLOCK_V": GPU_BLOCK_V}, arch, dtype, aligned,
                                             Path(tmp)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("fused_compiled.py compiles for CUDA targets: run it without TRITON_INTERPRET")
    sys.path.insert(0, str(REPO))
    rows = report()
    text = json.dumps(rows, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
