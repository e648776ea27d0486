"""Compiled kernels' artifacts: written from the registry's records on the GPU, read anywhere.

An entry that is ours hands the driver, through `compiled_kernels()`, a CompiledKernel record
(attnscope/attention/registry.py) for each kernel its profiled forwards launched: source, launch
config, the compiler's stages and metadata. `write()` puts each record in a folder, named to sort
together (the profiler never imports a kernel module nor launches a kernel itself):

    NAME.0.py          the source it was compiled from (PTX `.loc` lines refer to it)
    NAME.1.ttir  .2.ttgir  .3.llir  .4.ptx   the compiler's stages, as Triton kept them
    NAME.5.sass        cuobjdump -sass of the cubin, when a cuobjdump is found
    NAME.meta.json     launch config, registers, spills, shared memory, Tensor Core verdict

`load_all()` reads a folder back; `instruction_mix()` and `ptx_line_map()` turn SASS/PTX into
what the report shows: instruction classes, and which source lines became which instructions.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

from attnscope.profile import runs
from attnscope.profile import tensor_cores as tc
# One SASS grammar for the Tensor Core verdict and for the instruction mix.
from attnscope.profile.tensor_cores import _SASS_LINE as SASS_LINE

STAGES = (("ttir", "1.ttir"), ("ttgir", "2.ttgir"), ("llir", "3.llir"), ("ptx", "4.ptx"))
SOURCE_SUFFIX, SASS_SUFFIX, META_SUFFIX = "0.py", "5.sass", "meta.json"
# The Gluon kernel is warp-specialized: its figures need this sentence beside them.
NOTES = {"_attn_fwd_hopper": (
    "warp-specialized: num_warps is the default partition's (one consumer warpgroup); the launch "
    "also runs the other consumer warpgroups and a loader warp padded to a warpgroup, and "
    "registers_per_thread is the kernel-wide figure that setmaxnreg raises to consumer_regs in "
    "the consumers")}


def folder_for(impl_name: str) -> Path:
    """Where, under a run folder, an entry's compiled artifacts go."""
    return Path(impl_name, "kernel")


def def_line(source: str, name: str) -> int | None:
    """1-based line of `def name(` in the source, where Perfetto readers should look."""
    match = re.search(rf"^def {re.escape(name)}\(", source, re.M)
    return source.count("\n", 0, match.start()) + 1 if match else None


def source_location(record) -> str:
    """`path:line` of the record's `def NAME(` (the path alone when the source lacks it)."""
    line = def_line(record.source, record.name)
    return f"{record.source_path}:{line}" if line else record.source_path


def verdict(record) -> dict:
    """Tier 2 (SASS, else PTX) for a record, from its own compiled code."""
    return tc.triton_kernel_verdict(SimpleNamespace(asm=record.asm))


def meta(record, shape, dtype: str, sass_written: bool) -> dict:
    data = record.metadata or {}
    return {
        "kernel": record.name,
        "source": source_location(record),
        "shape": list(shape), "dtype": dtype,
        "config": dict(record.config),  # as requested
        # What the compiler settled on; these can differ from the request (e.g. num_stages).
        "compiled": {"num_warps": data.get("num_warps"),
                     "num_stages": data.get("num_stages"),
                     "shared_memory_bytes": data.get("shared"),
                     "registers_per_thread": data.get("n_regs"),
                     "spills": data.get("n_spills"),
                     "target": str(data.get("target", ""))},
        "sass": sass_written,
        "tensor_cores": verdict(record),
        **({"note": NOTES[record.name]} if record.name in NOTES else {}),
    }


def write(records, folder, shape, dtype: str) -> list[dict]:
    """Write each CompiledKernel record's artifacts into `folder`; their metas, in order."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    metas = []
    for record in records:
        name = record.name
        runs.write_text(folder / f"{name}.{SOURCE_SUFFIX}", record.source)
        for key, suffix in STAGES:
            if isinstance(record.asm.get(key), str):
                runs.write_text(folder / f"{name}.{suffix}", record.asm[key])
        cubin, tool = record.asm.get("cubin"), tc.cuobjdump_path()
        sass_written = isinstance(cubin, bytes) and tool is not None
        if sass_written:
            runs.write_text(folder / f"{name}.{SASS_SUFFIX}", tc.disassemble(cubin, tool))
        metas.append(meta(record, shape, dtype, sass_written))
        runs.write_json(folder / f"{name}.{META_SUFFIX}", metas[-1])
    return metas


def load(folder, name: str) -> dict | None:
    """What write() wrote for kernel `name`, by key: meta (dict), folder, source, ptx, sass...
    (text); None when the folder holds no meta file for it."""
    folder = Path(folder)
    meta_path = folder / f"{name}.{META_SUFFIX}"
    try:
        found = {"meta": json.loads(meta_path.read_text()), "folder": folder, "name": name}
    except (OSError, ValueError):
        return None
    for key, suffix in (("source", SOURCE_SUFFIX), *STAGES, ("sass", SASS_SUFFIX)):
        path = folder / f"{name}.{suffix}"
        if path.is_file():
            found[key] = path.read_text()
    return found


def load_all(folder) -> list[dict]:
    """Every kernel's artifacts in `folder` (see load), by kernel name; [] when there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names = sorted(p.name.removesuffix(f".{META_SUFFIX}")
                   for p in folder.glob(f"*.{META_SUFFIX}"))
    return [found for found in map(lambda n: load(folder, n), names) if found]


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
