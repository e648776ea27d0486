"""Did a kernel use Tensor Cores, and how do we know? Three tiers of evidence, strongest first.

1. Hardware counters (Nsight Compute): what the SMs executed. See COUNTER_METRICS and
   counter_verdict for the rule, and the trap it avoids (HFMA2.MMA counted on the tensor pipe).
2. SASS (or PTX) of Triton kernels compiled in this process: count matrix instructions
   (HGMMA/HMMA/IMMA/QGMMA, wgmma.mma_async/mma.sync) against FFMA.
3. Kernel-name fingerprints for library kernels (cuBLAS, cuDNN, FlashAttention, PyTorch):
   NAME_FAMILIES, a table of families with their verdict and the reason. An unknown name is
   "unknown", never a guess.

Every verdict is a dict {"verdict": "yes"|"no"|"unknown", "evidence": tier, ...figures}; combine()
keeps the strongest tier and forward_summary() turns a forward's kernels into one line.
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

YES, NO, UNKNOWN = "yes", "no", "unknown"

# ---------------------------------------------------------------------------------------------
# Tier 3: kernel-name fingerprints
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NameFamily:
    family: str
    pattern: str  # regex, searched (not matched) in the full demangled name, case-sensitive
    verdict: str
    reason: str


# First match wins, so the exceptions come before the families they carve out of
# (FFMA GEMMs before "gemm", split-KV combine before flash_fwd, ...).
NAME_FAMILIES: tuple[NameFamily, ...] = (
    # --- Triton, first: inductor names embed the fused ops' names (softmax, copy, fill) -----
    NameFamily("inductor_pointwise_reduction", r"^triton_(poi|red|per)_", NO,
               "TorchInductor pointwise/reduction kernel: inductor emits tl.dot only in its "
               "template kernels (triton_tem_*), never in pointwise or reduction codegen"),
    NameFamily("triton", r"^triton_", UNKNOWN,
               "Triton kernel (inductor template, FlexAttention): the name carries no math type; "
               "the answer is in its SASS (tier 2) or counters (tier 1)"),
    # --- library GEMMs that run on CUDA cores -------------------------------------------------
    NameFamily("cublas_ffma_gemm", r"_ffma(_|$)", NO,
               "cuBLAS/xmma GEMM whose name ends its math type with _ffma: FP32 FFMA on CUDA "
               "cores (e.g. sm80_xmma_gemm_f32f32_f32f32_f32_*_ffma_*, SDPA math in FP32)"),
    NameFamily("cublas_sgemm", r"sgemm|dgemm", NO,
               "SIMT single/double-precision GEMM (ampere_sgemm_*, volta_sgemm_*): FFMA/DFMA on "
               "CUDA cores"),
    NameFamily("cublas_splitk_reduce", r"splitKreduce|splitKReduce", NO,
               "cuBLAS split-K epilogue: sums partial GEMM tiles, no matrix math"),
    # --- Hopper and Ampere library GEMMs on Tensor Cores --------------------------------------
    NameFamily("nvjet_fp32", r"nvjet_(sm\d+_)?sss_(?!tf32)", UNKNOWN,
               "cuBLAS nvjet kernel for FP32 operands without tf32 in its name: the name does "
               "not say whether it multiplies on CUDA cores or emulates FP32 on Tensor Cores"),
    NameFamily("nvjet", r"(^|\W)nvjet_", YES,
               "cuBLAS Hopper-generation GEMM kernels (nvjet_*); they exist to drive wgmma "
               "(HGMMA) and cuBLAS keeps FP32-FFMA GEMMs in sm80_xmma_*_ffma / sgemm kernels"),
    NameFamily("wgmma", r"wgmma|warpgroupsize|gmma_", YES,
               "name carries Hopper warpgroup MMA (wgmma/HGMMA), e.g. cuDNN/cutlass sm90 kernels"),
    NameFamily("cudnn_sdpa", r"cudnn_generated_fort_native_sdpa", YES,
               "cuDNN fused attention (graph-generated SDPA kernel; sm90 variants use wgmma, "
               "sm80 variants wmma/mma.sync)"),
    NameFamily("mma_shape", r"(^|_)(h|s|i|bf16_s|fp16_s)?(884|1688|16816|8816|16832)(gemm|conv)",
               YES,
               "cuBLAS/cuDNN naming of an MMA instruction shape (h884 Volta, h1688/s1688 Turing, "
               "s16816/h16816/i16832 Ampere+): Tensor Core GEMM"),
    NameFamily("hmma_imma", r"_hmma_|_imma_|_qgmma_|hmma_gemm|wmma", YES,
               "name carries the matrix instruction it is built on (HMMA/IMMA/QGMMA/wmma)"),
    NameFamily("xmma_low_precision", r"xmma_(gemm|conv\w*)_(bf16|f16|fp16|tf32|i8|e4m3|e5m2|"
               r"f32f32_tf32|f32f32_bf16|f32f32_f16)", YES,
               "cuBLAS/cuDNN xmma kernel whose operand types are bf16/fp16/tf32/int8/fp8: these "
               "types are issued as HMMA/HGMMA/IMMA"),
    NameFamily("ampere_half", r"(^|\W)(ampere|hopper|sm\d\d)_(bf16|fp16|h|tf32)_", YES,
               "cuBLAS kernel for half/bf16/tf32 operands (ampere_bf16_*, ampere_fp16_*)"),
    NameFamily("cutlass_tensorop", r"cutlass\w*tensorop|cutlass3x_sm\d+_tensorop", YES,
               "CUTLASS kernel instantiated with OpClassTensorOp"),
    NameFamily("cutlass_simt", r"cutlass\w*simt", NO,
               "CUTLASS kernel instantiated with OpClassSimt: CUDA-core FMA"),
    # --- fused attention ----------------------------------------------------------------------
    NameFamily("flash_combine", r"flash_fwd_splitkv_combine|combine_kernel", NO,
               "FlashAttention split-KV combine: rescales and sums partial outputs, no matrix "
               "math"),
    NameFamily("flash_bwd_helpers",
               r"flash_bwd_(dot_do_o|convert_dq|convert_dkv|clear_dkvaccum)_kernel", NO,
               "FlashAttention 2 backward helpers (flash-attn 2, and PyTorch's pytorch_flash:: "
               "copy): rowsum(dO*O), zeroing the dK/dV accumulators, fp32 to 16-bit conversion "
               "of dQ/dK/dV; elementwise and reductions, no matrix math"),
    NameFamily("fa4_helpers",
               r"FlashAttentionBackward(Pre|Post)process|FlashAttentionForwardCombine", NO,
               "FlashAttention-4 (CuTe DSL) helpers: the backward's rowsum(dO*O) and LSE scaling "
               "(preprocess), dQ's fp32 to 16-bit conversion (postprocess), the split-KV "
               "combine; no matrix math"),
    NameFamily("fa4", r"FlashAttention(Forward|Backward)Sm\d+", YES,
               "FlashAttention-4 CuTe DSL kernel (traces name it kernel_cutlass_kernel_"
               "flash_attncute<module><class>_object_at_...): the Sm90 classes issue the "
               "attention GEMMs as wgmma (HGMMA), Sm100 as tcgen05.mma, Sm80/Sm120 as mma.sync"),
    NameFamily("flash_attn", r"(pytorch_flash::|flash::|^|\W)flash_(fwd|bwd)\w*kernel|"
               r"FlashAttnFwdSm90|FlashAttnBwdSm90", YES,
               "FlashAttention (PyTorch's pytorch_flash:: copy of FA2, hub/flash-attn flash::): "
               "QK^T and PV on mma.sync (HMMA), FA3 Sm90 on wgmma"),
    NameFamily("mem_efficient_sm80", r"fmha_cutlass[FB]_\w*_sm(80|90)", YES,
               "PyTorch memory-efficient attention (xformers CUTLASS kernel) for sm80+: "
               "TensorOp GEMMs (bf16/fp16 HMMA, fp32 as 3xTF32)"),
    NameFamily("mem_efficient_sm50", r"fmha_cutlass[FB]_\w*_sm50", NO,
               "memory-efficient attention's sm50 fallback: SIMT, no Tensor Cores"),
    # --- PyTorch and driver kernels that do no matrix math ------------------------------------
    NameFamily("memcpy_memset", r"^(Memcpy|Memset)\b", NO, "copy engine or memset, not an SM "
               "kernel"),
    NameFamily("softmax", r"[Ss]oft[Mm]ax|softmax_warp", NO,
               "PyTorch softmax (cunn_SoftMaxForward*, softmax_warp_forward): exp, max and sum"),
    NameFamily("elementwise", r"elementwise_kernel|unrolled_elementwise|vectorized_elementwise|"
               r"elementwise_kernel_with_index|index_elementwise", NO,
               "PyTorch TensorIterator elementwise kernel (mul, masked_fill, fill, cast, copy)"),
    NameFamily("reduce_scan", r"reduce_kernel|[Rr]eduction|tensor_kernel_scan|scan_", NO,
               "PyTorch reduction/scan kernel"),
    NameFamily("fill_copy_index", r"[Ff]ill|[Cc]opy|masked_fill|index[A-Z]|indexing|"
               r"triu_tril|gather|scatter|CatArray|transpose", NO,
               "fill, copy, concat, transpose, triu/tril or indexing kernel: data movement"),
)

_COMPILED_FAMILIES = tuple((f, re.compile(f.pattern)) for f in NAME_FAMILIES)


def name_verdict(kernel_name: str) -> dict:
    """Tier 3: the verdict a kernel's name supports, with the reason; "unknown" when no family
    in NAME_FAMILIES matches (or the family itself cannot tell, as for Triton kernels)."""
    for family, regex in _COMPILED_FAMILIES:
        if regex.search(kernel_name):
            return {"verdict": family.verdict, "evidence": "name",
                    "reason": f"{family.family}: {family.reason}", "family": family.family}
    return {"verdict": UNKNOWN, "evidence": "name",
            "reason": "no known kernel family matches this name (a Triton kernel carries only its "
                      "function name; its SASS or counters can tell)", "family": None}


# ---------------------------------------------------------------------------------------------
# Tier 2: SASS (or PTX) of Triton kernels compiled in this process
# ---------------------------------------------------------------------------------------------

# SASS opcodes that issue matrix math on the Tensor Cores: warp-level MMA (Volta..Ada, and
# Hopper for small tiles) and warpgroup GMMA (Hopper). HFMA2.MMA is *not* one of them: it is a
# packed half FMA that ptxas schedules on the tensor pipe (often to materialise constants), and
# it is why the hmma-pipe counter of tier 1 lies for softmax kernels.
SASS_MATRIX_OPCODES = ("HGMMA", "HMMA", "IMMA", "QGMMA", "IGMMA", "BGMMA", "DMMA", "BMMA")
SASS_CONTEXT_OPCODES = ("FFMA", "HFMA2", "HFMA2.MMA", "MUFU.EX2")

# "/*0aa0*/  @!P0 HGMMA.64x64x16.F32.BF16 R24, ..." -> "HGMMA", ".64x64x16.F32.BF16"
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)"
                        r"((?:\.[A-Za-z0-9_]+)*)")

# PTX matrix instructions: warpgroup (sm90), warp-level mma/wmma, Blackwell tcgen05.
_PTX_MATRIX = {
    "wgmma.mma_async": re.compile(r"^\s*(@%?!?\w+\s+)?wgmma\.mma_async\b", re.M),
    "mma.sync": re.compile(r"^\s*(@%?!?\w+\s+)?mma\.sync\b", re.M),
    "wmma.mma": re.compile(r"^\s*(@%?!?\w+\s+)?wmma\.mma\b", re.M),
    "tcgen05.mma": re.compile(r"^\s*(@%?!?\w+\s+)?tcgen05\.mma\b", re.M),
}
_PTX_CONTEXT = {
    "fma.f32": re.compile(r"^\s*(@%?!?\w+\s+)?fma\.rn(\.ftz)?(\.sat)?\.f32\b", re.M),
    "fma.f16x2": re.compile(r"^\s*(@%?!?\w+\s+)?fma\.rn(\.ftz)?(\.relu)?\.(bf16x2|f16x2)\b",
                            re.M),
    "ex2": re.compile(r"^\s*(@%?!?\w+\s+)?ex2\.approx\b", re.M),
}


def _static_verdict(counts: dict, matrix_keys, evidence: str) -> dict:
    matrix = sum(counts[k] for k in matrix_keys)
    if counts["instructions"] == 0:
        verdict = UNKNOWN  # nothing parsed: wrong input, not evidence of absence
    else:
        verdict = YES if matrix > 0 else NO
    return {"verdict": verdict, "evidence": evidence, "counts": counts}


def sass_verdict(sass: str) -> dict:
    """Tier 2 from `cuobjdump -sass` text: static counts of matrix instructions versus FFMA.
    A kernel whose code holds any matrix instruction multiplies on Tensor Cores."""
    counts = dict.fromkeys((*SASS_MATRIX_OPCODES, *SASS_CONTEXT_OPCODES, "instructions"), 0)
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if not m:
            continue
        opcode, modifiers = m.groups()
        counts["instructions"] += 1
        if opcode == "HFMA2" and modifiers.startswith(".MMA"):
            counts["HFMA2.MMA"] += 1
        elif opcode == "MUFU" and modifiers.startswith(".EX2"):
            counts["MUFU.EX2"] += 1
        elif opcode in counts:
            counts[opcode] += 1
    return _static_verdict(counts, SASS_MATRIX_OPCODES, "sass")


def ptx_verdict(ptx: str) -> dict:
    """Tier 2 fallback from PTX text, for when no disassembler is at hand. Weaker than SASS:
    ptxas lowers each PTX matrix instruction to several SASS ones, and PTX is virtual code."""
    counts = {name: len(rx.findall(ptx)) for name, rx in {**_PTX_MATRIX, **_PTX_CONTEXT}.items()}
    # Statements end with ';' one per line; directives and labels do not count as instructions.
    statements = (line.strip() for line in ptx.splitlines())
    counts["instructions"] = sum(1 for s in statements if s.endswith(";") and s[:1] != ".")
    return _static_verdict(counts, _PTX_MATRIX, "ptx")


def cuobjdump_path() -> str | None:
    """The CUDA toolkit's cuobjdump, else the one Triton ships (same tool, pinned to its ptxas)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.is_file() else None


def disassemble(cubin: bytes, cuobjdump: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True,
                              check=True, timeout=60).stdout


def triton_kernel_verdict(kernel) -> dict:
    """Tier 2 for one compiled Triton kernel (triton's CompiledKernel, or any object with an
    `asm` dict holding 'cubin' bytes and/or 'ptx' text): SASS when a disassembler is present,
    else PTX, else "unknown"."""
    asm = getattr(kernel, "asm", None) or {}
    # dict.get, not [] : triton's AsmDict disassembles on a missing 'sass' key, with its own tool.
    cubin, ptx = asm.get("cubin"), asm.get("ptx")
    tool = cuobjdump_path()
    if isinstance(cubin, bytes) and tool:
        try:
            return sass_verdict(disassemble(cubin, tool))
        except (OSError, subprocess.SubprocessError):
            pass  # a broken or foreign disassembler: PTX still answers
    if isinstance(ptx, str):
        return ptx_verdict(ptx)
    return {"verdict": UNKNOWN, "evidence": "sass", "counts": {},
            "reason": "compiled kernel holds neither a cubin nor PTX"}


# ---------------------------------------------------------------------------------------------
# Tier 1: hardware counters from Nsight Compute
# ---------------------------------------------------------------------------------------------

# Metric names as `ncu --query-metrics` lists them on the H200 (ncu 2025.3). One place, so the
# rule can be re-tuned after a measurement. Instruction counts are exact (ncu replays each
# kernel and reads every SM), not sampled.
GMMA = "sm__inst_executed_pipe_tensor_op_gmma.sum"  # warpgroup HGMMA/QGMMA (Hopper)
HMMA = "sm__inst_executed_pipe_tensor_op_hmma.sum"  # HMMA, HGMMA, QGMMA *and HFMA2.MMA*
HFMA2_MMA = "sm__inst_executed_pipe_tensor_op_hmma_type_hfma2.sum"  # the HFMA2.MMA part of HMMA
IMMA = "sm__inst_executed_pipe_tensor_op_imma.sum"  # IMMA/IGMMA/BMMA/BGMMA
DMMA = "sm__inst_executed_pipe_tensor_op_dmma.sum"  # FP64 MMA
FFMA_THREADS = "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum"  # FP32 FMAs, per thread
TENSOR_PIPE_PCT = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
FMA_PIPE_PCT = "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"
DURATION = "gpu__time_duration.sum"
COUNTER_METRICS = (GMMA, HMMA, HFMA2_MMA, IMMA, DMMA, FFMA_THREADS, TENSOR_PIPE_PCT, FMA_PIPE_PCT,
                   DURATION)
RULE_INPUTS = (GMMA, HMMA, HFMA2_MMA, IMMA, DMMA)

# A kernel multiplies on Tensor Cores when it executed at least this many matrix instructions.
# One suffices: the counts are exact, and once HFMA2.MMA is taken out nothing but an MMA is
# left on the tensor pipe, so a kernel without matrix math reads exactly 0. Raise it only if a
# measurement shows residues on kernels known to do no matrix math.
MIN_MATRIX_INSTRUCTIONS = 1
COUNTER_RULE = (f"matrix instructions = max({HMMA} - {HFMA2_MMA}, {GMMA}) + {IMMA} + {DMMA}; "
                f"yes when >= {MIN_MATRIX_INSTRUCTIONS}. Tensor-pipe activity and the raw hmma "
                "count are not used: HFMA2.MMA keeps both above zero in softmax and elementwise "
                "kernels that do no matrix math.")


def matrix_instructions(metrics: dict) -> float:
    """Executed matrix instructions. GMMA may or may not be folded into the hmma-pipe count
    depending on the ncu version; max() counts it once either way."""
    return (max(metrics[HMMA] - metrics[HFMA2_MMA], metrics[GMMA]) + metrics[IMMA]
            + metrics[DMMA])


def counter_verdict(metrics: dict) -> dict:
    """Tier 1 from one kernel's Nsight Compute metrics (name -> number)."""
    figures = {k: metrics[k] for k in COUNTER_METRICS if metrics.get(k) is not None}
    missing = [k for k in RULE_INPUTS if metrics.get(k) is None]
    if missing:
        return {"verdict": UNKNOWN, "evidence": "counters", "metrics": figures,
                "rule": COUNTER_RULE, "reason": "missing metrics: " + ", ".join(missing)}
    matrix = matrix_instructions(metrics)
    figures["matrix_instructions"] = matrix
    return {"verdict": YES if matrix >= MIN_MATRIX_INSTRUCTIONS else NO, "evidence": "counters",
            "metrics": figures, "rule": COUNTER_RULE}


_UNIT_PREFIX = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BASE_UNITS = {"inst", "byte", "cycle", "warp", "thread", "sector", "request"}


def _number(text: str, unit: str = "") -> float | None:
    """ncu's numbers: "1,234,567", "12.5", "n/a"; scaled units ("Minst") when run without
    `--print-units base`."""
    text = text.strip().replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return None
    if unit[:1] in _UNIT_PREFIX and unit[1:] in _BASE_UNITS:
        value *= _UNIT_PREFIX[unit[:1]]
    return value


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernel launches from `ncu --csv` output: [{"id", "kernel", "metrics": {name: number}}].

    Reads both layouts: `--page raw` (one row per launch, a column per metric, then a units row)
    and the default details page (one row per metric with "Metric Name/Unit/Value"). Lines that
    are not part of the table (==PROF== notes, the program's own output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise ValueError("no ncu CSV table found (expected a header line starting with \"ID\")")
    rows = list(csv.reader(line for line in lines[start:] if line.startswith('"')))
    header, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(header)}
    launches: dict[str, dict] = {}

    def launch(row):
        return launches.setdefault(row[col["ID"]], {"id": int(row[col["ID"]]),
                                                    "kernel": row[col["Kernel Name"]],
                                                    "metrics": {}})

    if "Metric Name" in col:
        for row in body:
            if len(row) == len(header) and row[col["Metric Name"]]:
                launch(row)["metrics"][row[col["Metric Name"]]] = _number(
                    row[col["Metric Value"]], row[col.get("Metric Unit", 0)])
    else:
        metric_cols = [(name, i) for name, i in col.items() if "__" in name]
        units = {}
        for row in body:
            if len(row) != len(header):
                continue
            if not row[col["ID"]]:  # the units row under the header
                units = {name: row[i] for name, i in metric_cols}
                continue
            launch(row)["metrics"].update(
                (name, _number(row[i], units.get(name, ""))) for name, i in metric_cols)
    return sorted(launches.values(), key=lambda r: r["id"])


def counter_verdicts(launches: list[dict]) -> dict[str, dict]:
    """Tier 1 per kernel name, from metrics averaged over that name's launches; where there are
    several, `matrix_instructions_range` holds the least and most one launch executed (the
    mean's figures describe no single launch when they differ)."""
    by_name: dict[str, list[dict]] = {}
    for launch in launches:
        by_name.setdefault(launch["kernel"], []).append(launch["metrics"])
    out = {}
    for name, runs in by_name.items():
        keys = {k for run in runs for k in run}
        mean = {}
        for k in keys:
            values = [run[k] for run in runs if run.get(k) is not None]
            mean[k] = sum(values) / len(values) if values else None
        out[name] = {**counter_verdict(mean), "launches": len(runs)}
        each = [matrix_instructions(run) for run in runs
                if all(run.get(k) is not None for k in RULE_INPUTS)]
        if len(runs) > 1 and each:
            out[name]["matrix_instructions_range"] = [min(each), max(each)]
    return out


# ---------------------------------------------------------------------------------------------
# Combining tiers, and one line per forward
# ---------------------------------------------------------------------------------------------

TIER_STRENGTH = {"counters": 3, "sass": 2, "ptx": 1, "name": 0}


def combine(*verdicts: dict | None) -> dict:
    """The strongest tier with a definite answer wins; weaker tiers stay visible under `other`
    (a disagreement there is worth a look). All unknown: the strongest unknown."""
    given = sorted((v for v in verdicts if v), key=lambda v: -TIER_STRENGTH[v["evidence"]])
    if not given:
        return {"verdict": UNKNOWN, "evidence": "name", "reason": "no evidence"}
    best = next((v for v in given if v["verdict"] != UNKNOWN), given[0])
    other = {v["evidence"]: v["verdict"] for v in given if v is not best}
    return {**best, "other": other} if other else dict(best)


def short_name(kernel_name: str) -> str:
    """`void at::native::foo<...>(...)` -> `at::native::foo`, for one-line summaries."""
    name = kernel_name.removeprefix("void ")
    return re.split(r"[<(]", name, maxsplit=1)[0].strip() or kernel_name


# A CuTe DSL kernel's name (FA4's): kernel_cutlass_kernel_<module path without dots, lower
# case><class>_object_at_<argument layouts>, 150-400 characters
_CUTE_DSL_NAME = re.compile(
    r"kernel_cutlass_kernel_(?:(?!tensor)[a-z0-9_])*?([A-Z][A-Za-z0-9]*)_object_at_")


def display_name(kernel_name: str) -> str:
    """A kernel's name for tables and console lines: a CuTe DSL kernel's class (e.g.
    `FlashAttentionBackwardSm90`); else short_name of the name with an anonymous namespace
    (Kineto's `(anonymous namespace)::`, ncu's `<unnamed>::`) dropped first: its brackets would
    end the short name before it starts, leaving the whole name, template arguments and all.
    results.json's kernels keep the whole name; its "partial: ..." verdicts list these."""
    cute = _CUTE_DSL_NAME.match(kernel_name)
    if cute:
        return cute.group(1)
    return short_name(re.sub(r"\(anonymous namespace\)::|<unnamed>::", "", kernel_name))


def forward_summary(kernels: list[dict]) -> dict:
    """One forward's verdict from its kernels ([{"name", "tensor_cores": verdict}]):
    "yes" (all kernels), "no" (none), "partial: <kernels that do>", or "unknown" when no kernel
    says yes and some cannot tell; `unknown` counts the distinct kernels that cannot tell where
    some say yes (a "partial" does not say those use no Tensor Cores). `evidence` lists the
    tiers used, strongest first: the summary is only as strong as the weakest of them."""
    verdicts = [(k["name"], k.get("tensor_cores") or name_verdict(k["name"])) for k in kernels]
    tiers = sorted({v["evidence"] for _, v in verdicts}, key=lambda t: -TIER_STRENGTH[t])
    yes = [display_name(n) for n, v in verdicts if v["verdict"] == YES]
    unknown = len({n for n, v in verdicts if v["verdict"] == UNKNOWN})
    if not verdicts:
        verdict = UNKNOWN
    elif len(yes) == len(verdicts):
        verdict = YES
    elif yes:
        verdict = "partial: " + ", ".join(dict.fromkeys(yes))
    else:
        verdict = UNKNOWN if unknown else NO
    summary = {"verdict": verdict, "evidence": ", ".join(tiers)}
    if yes and unknown:
        summary["unknown"] = unknown
    return summary
