"""The fused kernel's compiled artifacts for one shape: written on the GPU, read anywhere.

`dump()` launches attnscope.kernels.attention_fwd.attention_fwd eagerly on the profiled inputs
(the JIT cache hands back the very kernel the trace shows) and writes, named to sort together:

    _attn_fwd.0.py          the Triton source it was compiled from (PTX `.loc` lines refer to it)
    _attn_fwd.1.ttir  .2.ttgir  .3.llir  .4.ptx   Triton's stages, as Triton kept them
    _attn_fwd.5.sass        cuobjdump -sass of the cubin, when a cuobjdump is found
    _attn_fwd.meta.json     launch config, registers, spills, shared memory, Tensor Core verdict

`load()` reads a folder back; `instruction_mix()` and `ptx_line_map()` turn SASS/PTX into what the
report shows: instruction classes, and which source lines became which instructions.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from collections import Counter, defaultdict
from pathlib import Path

from attnscope.profile import tensor_cores as tc
# One SASS grammar for the Tensor Core verdict and for the instruction mix.
from attnscope.profile.tensor_cores import _SASS_LINE as SASS_LINE

KERNEL = "_attn_fwd"  # the Triton kernel, and the file-name prefix of every artifact
MODULE = "attnscope.kernels.attention_fwd"
SOURCE_PATH = "attnscope/kernels/attention_fwd.py"  # as a reader finds it in the repository
# Where the op runs the Gluon kernel instead (kernels.uses_hopper_kernel), its artifacts are
# written under the same file names, with this source and kernel name in the meta.
HOPPER_KERNEL = "_attn_fwd_hopper"
HOPPER_MODULE = "attnscope.kernels.attention_fwd_hopper"
HOPPER_SOURCE_PATH = "attnscope/kernels/attention_fwd_hopper.py"
STAGES = (("ttir", "1.ttir"), ("ttgir", "2.ttgir"), ("llir", "3.llir"), ("ptx", "4.ptx"))
SOURCE_SUFFIX, SASS_SUFFIX, META_SUFFIX = "0.py", "5.sass", "meta.json"


class NeedsGPU(RuntimeError):
    """There is no compiled kernel to dump: the Triton interpreter compiles nothing."""


def source_file(module: str = MODULE) -> Path:
    # find_spec, not import: importing the kernel module defines the kernels (and on a CPU
    # machine, decides they are interpreted).
    return Path(importlib.util.find_spec(module).origin)


def def_line(source: str, name: str = KERNEL) -> int | None:
    """1-based line of `def name(` in the source, where Perfetto readers should look."""
    match = re.search(rf"^def {re.escape(name)}\(", source, re.M)
    return source.count("\n", 0, match.start()) + 1 if match else None


def source_location(source: str | None = None, path: str = SOURCE_PATH,
                    name: str = KERNEL) -> str:
    """`path:line` of `def name(` (the Triton kernel by default)."""
    source = source_file().read_text() if source is None else source
    return f"{path}:{def_line(source, name)}"


def compile_for(q, k, v):
    """The CompiledKernel, its launch config and its origin (module, source path, kernel name)
    that the fused op launches for these [batch, heads, seq, head_dim] inputs (causal, default
    scale, top-left alignment, as the `fused` registry entry calls it): the Triton kernel, or
    the Gluon one where kernels.uses_hopper_kernel says so. Eager runs that differentiate launch
    the same forward (only traced ones, under torch.compile, take the wrapped Triton launch)."""
    import torch

    kernels = importlib.import_module(MODULE)
    if kernels.is_interpreted():
        raise NeedsGPU("the fused kernel runs in the Triton interpreter here, which compiles "
                       "nothing; compiled artifacts need a CUDA GPU run")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    hopper = kernels.uses_hopper_kernel(q, k, v, out, scale)
    kernel = kernels.attention_fwd(q, k, v, out, lse, causal=True, scale=scale, causal_offset=0)
    if hopper:
        module = importlib.import_module(HOPPER_MODULE)
        config = dict(zip(module.CONFIG_FIELDS, module.CONFIGS[q.shape[-1]]))
        return kernel, config, (HOPPER_MODULE, HOPPER_SOURCE_PATH, HOPPER_KERNEL)
    config = dict(zip(kernels.CONFIG_FIELDS, kernels.config_for(q.shape[-1], q.shape[2], True)))
    return kernel, config, (MODULE, SOURCE_PATH, KERNEL)


def _meta(kernel, config, q, sass_written: bool, origin=(MODULE, SOURCE_PATH, KERNEL)) -> dict:
    metadata = kernel.metadata
    module, path, name = origin
    source = source_file(module).read_text()
    return {
        "kernel": getattr(metadata, "name", name),
        "source": source_location(source, path, name),
        "shape": list(q.shape), "dtype": str(q.dtype).removeprefix("torch."),
        "config": config,  # as requested; use_tma also needs 16-byte aligned K/V
        # What the compiler settled on; these can differ from the request (e.g. num_stages).
        "compiled": {"num_warps": getattr(metadata, "num_warps", None),
                     "num_stages": getattr(metadata, "num_stages", None),
                     "shared_memory_bytes": getattr(metadata, "shared", None),
                     "registers_per_thread": getattr(kernel, "n_regs", None),
                     "spills": getattr(kernel, "n_spills", None),
                     "target": str(getattr(metadata, "target", ""))},
        "sass": sass_written,
        "tensor_cores": tc.triton_kernel_verdict(kernel),
        **({"note": "warp-specialized: num_warps is the default partition's (one consumer "
                    "warpgroup); the launch also runs the other consumer warpgroups and a loader "
                    "warp padded to a warpgroup, and registers_per_thread is the kernel-wide "
                    "figure that setmaxnreg raises to consumer_regs in the consumers"}
           if name == HOPPER_KERNEL else {}),
    }


def dump(q, k, v, folder) -> list[Path]:
    """Write the fused kernel's artifacts for these inputs into `folder`; the written paths.
    Raises NeedsGPU on the interpreter."""
    kernel, config, origin = compile_for(q, k, v)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / f"{KERNEL}.{SOURCE_SUFFIX}"]
    shutil.copyfile(source_file(origin[0]), written[0])
    asm = kernel.asm
    for key, suffix in STAGES:
        if isinstance(asm.get(key), str):
            written.append(folder / f"{KERNEL}.{suffix}")
            written[-1].write_text(asm[key])
    cubin, tool = asm.get("cubin"), tc.cuobjdump_path()
    sass_written = isinstance(cubin, bytes) and tool is not None
    if sass_written:
        written.append(folder / f"{KERNEL}.{SASS_SUFFIX}")
        written[-1].write_text(tc.disassemble(cubin, tool))
    written.append(folder / f"{KERNEL}.{META_SUFFIX}")
    meta = _meta(kernel, config, q, sass_written, origin)
    written[-1].write_text(json.dumps(meta, indent=1) + "\n")
    return written


def load(folder) -> dict | None:
    """What dump() wrote, by key: meta (dict), source, ptx, sass... (text); None when the
    folder holds no meta file."""
    folder = Path(folder)
    meta = folder / f"{KERNEL}.{META_SUFFIX}"
    if not meta.is_file():
        return None
    found = {"meta": json.loads(meta.read_text()), "folder": folder}
    for key, suffix in (("source", SOURCE_SUFFIX), *STAGES, ("sass", SASS_SUFFIX)):
        path = folder / f"{KERNEL}.{suffix}"
        if path.is_file():
            found[key] = path.read_text()
    return found


# ---------------------------------------------------------------------------------------------
# Instruction classes
# ---------------------------------------------------------------------------------------------

MIX_CLASSES = ("matrix", "exp2", "other special functions", "fp32 fma/mul/add", "global loads",
               "shared loads", "global stores", "shared stores", "barriers", "all instructions")

_SASS_CLASSES = {
    **dict.fromkeys(tc.SASS_MATRIX_OPCODES, "matrix"),
    "FFMA": "fp32 fma/mul/add", "FMUL": "fp32 fma/mul/add", "FADD": "fp32 fma/mul/add",
    # LDGSTS is cp.async (global -> shared), UTMALDG a TMA load: both read global memory.
    "LDG": "global loads", "LDGSTS": "global loads", "UTMALDG": "global loads",
    "LDS": "shared loads", "LDSM": "shared loads",
    "STG": "global stores", "UTMASTG": "global stores", "STS": "shared stores",
    "STSM": "shared stores", "BAR": "barriers",
}
_PTX_CLASSES = (  # (opcode prefix, class); first match wins
    ("wgmma.mma_async", "matrix"), ("mma.sync", "matrix"), ("wmma.mma", "matrix"),
    ("tcgen05.mma", "matrix"), ("ex2.", "exp2"),
    ("lg2.", "other special functions"), ("rcp.", "other special functions"),
    ("sqrt.", "other special functions"), ("rsqrt.", "other special functions"),
    ("fma.rn.f32", "fp32 fma/mul/add"), ("fma.rn.ftz.f32", "fp32 fma/mul/add"),
    ("mul.f32", "fp32 fma/mul/add"), ("mul.rn.f32", "fp32 fma/mul/add"),
    ("add.f32", "fp32 fma/mul/add"), ("sub.f32", "fp32 fma/mul/add"),
    ("ld.global", "global loads"), ("cp.async.bulk.tensor", "global loads"),
    ("cp.async.cg", "global loads"), ("cp.async.ca", "global loads"),
    ("ld.shared", "shared loads"), ("ldmatrix", "shared loads"),
    ("st.global", "global stores"), ("st.shared", "shared stores"), ("stmatrix", "shared stores"),
    ("bar.", "barriers"), ("barrier.", "barriers"),
)


def _sass_class(opcode: str, modifiers: str) -> str | None:
    if opcode == "MUFU":
        return "exp2" if modifiers.startswith(".EX2") else "other special functions"
    return _SASS_CLASSES.get(opcode)


def _ptx_instruction(line: str) -> str | None:
    """The opcode of a PTX statement line (predicate stripped); None for directives, labels,
    braces and comments."""
    s = line.split("//", 1)[0].strip()
    if not s.endswith(";") or s[0] in ".{}":
        return None
    if s.startswith("@"):
        s = s.split(None, 1)[1] if " " in s else ""
    return s.split(None, 1)[0].rstrip(";") if s else None


def _ptx_class(opcode: str) -> str | None:
    if opcode.startswith("cp.async.bulk.tensor") and ".global.shared" in opcode:
        return "global stores"  # TMA store: shared -> global
    return next((cls for prefix, cls in _PTX_CLASSES if opcode.startswith(prefix)), None)


def instruction_mix(text: str, kind: str) -> dict[str, int]:
    """Static instruction counts by class (MIX_CLASSES) of SASS (`kind="sass"`) or PTX text."""
    mix = dict.fromkeys(MIX_CLASSES, 0)
    for line in text.splitlines():
        if kind == "sass":
            m = SASS_LINE.match(line)
            if not m:
                continue
            cls = _sass_class(*m.groups())
        else:
            opcode = _ptx_instruction(line)
            if opcode is None:
                continue
            cls = _ptx_class(opcode)
        mix["all instructions"] += 1
        if cls:
            mix[cls] += 1
    return mix


# `.loc 1 64 14, function_name $L__info_string0, inlined_at 1 140 21 // ...`
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+(?:.*?inlined_at\s+(\d+)\s+(\d+))?")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')


def ptx_line_map(ptx: str, source_name: str) -> dict[int, dict]:
    """Per line of the source file called `source_name` (matched by file name: the PTX holds the
    compiling machine's absolute path), what PTX its `.loc` directives attribute to it:
    {line: {"classes": Counter, "instructions": [text, ...], "inlined": Counter}}.
    `inlined` counts, at a call site of an inlined @triton.jit function (e.g. the two calls of
    the K/V loop), the classes of the instructions the callee's lines produced there."""
    files = {m.group(1): Path(m.group(2)).name for m in map(_FILE.match, ptx.splitlines()) if m}
    ours = {number for number, name in files.items() if name == Path(source_name).name}
    lines: dict[int, dict] = defaultdict(lambda: {"classes": Counter(), "instructions": [],
                                                  "inlined": Counter()})
    here = call_site = None
    for line in ptx.splitlines():
        loc = _LOC.match(line)
        if loc:
            f, n, call_f, call_n = loc.groups()
            here = int(n) if f in ours else None
            call_site = int(call_n) if call_f in ours else None
            continue
        opcode = _ptx_instruction(line)
        if opcode is None or here is None:
            continue
        cls = _ptx_class(opcode) or "other"
        entry = lines[here]
        entry["classes"][cls] += 1
        entry["instructions"].append(line.strip())
        if call_site is not None:
            lines[call_site]["inlined"][cls] += 1
    return dict(lines)
