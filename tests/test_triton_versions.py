"""The Hopper kernel and the direct launcher against the Triton installed (CI installs the newest).

Gluon is experimental and Triton's launcher is private: a new Triton can rename what the Gluon
kernel calls or reorder what the launcher takes, and either would surface only on a GPU. These
tests catch it on the CPU machine: the Gluon kernel is compiled for sm_90 (Triton compiles to PTX
and, with the ptxas its wheel ships, to SASS without a GPU), and _Bound's direct launch is
compared, argument by argument, with what Triton's own CudaLauncher passes to the launcher.
"""

import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest
import torch
import triton

from attnscope.kernels import dispatch, gluon_compat, launch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter with TRITON_INTERPRET=0 (this process has the interpreter on, and
# Triton reads that once, at import): compile the Gluon kernel as a launch would, through
# benchmarks/sass_offline.py's offline driver, at each head_dim given ("p128": its packed-batch
# variant, fused_attention_varlen's; "s128": a dense call of bshd tensors, seen at their
# strides), and count what the PTX and SASS hold.
_COMPILE = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
import sass_offline
result = {}
for name in sys.argv[2:]:
    if name.startswith("b"):  # the backward's dK/dV ("b") and dQ ("bq") kernels, "n": not causal,
        # "d": the dK/dV kernel that adds dQ too (deterministic=False's), "s": bshd views (STRIDED),
        # "w": a sliding window of 256 keys and a softcap of 50
        window, softcap = ((256, 0), 50.0) if "w" in name else ((-1, -1), 0.0)
        compiled = sass_offline.compile_gluon_bwd(int(name.lstrip("bqndsw")), "bf16",
                                                  dq="q" in name, causal="n" not in name,
                                                  fused_dq="d" in name, bshd="s" in name,
                                                  window=window, softcap=softcap)
    elif name.startswith("w"):  # "w{head_dim}": a sliding window of 256 keys and a softcap of 50
        compiled = sass_offline.compile_gluon(int(name[1:]), None, "bf16", window=(256, 0),
                                              softcap=50.0)
    elif name.startswith("f"):  # "f{head_dim}k{keys}": layout_for's layout there, many tiles
        from attnscope.kernels.attention_fwd_hopper import layout_for
        head_dim, keys = map(int, name[1:].split("k"))
        parts, config = layout_for(head_dim, keys, True)
        compiled = sass_offline.compile_gluon(head_dim, config, "bf16", parts=parts, keys=keys)
    elif name.startswith("s"):  # "s{head_dim}": bshd inputs, the STRIDED kernel
        compiled = sass_offline.compile_gluon(int(name[1:]), None, "bf16", bshd=True)
    elif name.startswith("t"):  # "t{head_dim}": THREE_CONSUMERS' config (192-row tiles)
        from attnscope.kernels.attention_fwd_hopper import THREE_CONSUMERS
        head_dim = int(name[1:])
        compiled = sass_offline.compile_gluon(head_dim, THREE_CONSUMERS[head_dim], "bf16")
    elif name.startswith("o"):  # "o{head_dim}": 128 keys, one K/V block a tile
        compiled = sass_offline.compile_gluon(int(name[1:]), None, "bf16", keys=128)
    else:
        compiled = sass_offline.compile_gluon(int(name.lstrip("p")), None, "bf16",
                                              varlen=name.startswith("p"))
    ptx = compiled.asm["ptx"]
    counts = result[name] = {"ptx": {name: len(re.findall(pattern, ptx)) for name, pattern in (
        ("wgmma", r"wgmma\.mma_async"), ("tma_load", r"cp\.async\.bulk\.tensor\.\dd\.shared"),
        ("tma_store", r"cp\.async\.bulk\.tensor\.\dd\.global"), ("mbarrier", r"mbarrier\."),
        ("tma_4d", r"cp\.async\.bulk\.tensor\.4d"),
        ("tma_reduce", r"cp\.reduce\.async\.bulk\.tensor"),
        ("setmaxnreg", r"setmaxnreg"), ("atomic", r"\b(atom|red)\.global"),
        ("vote", r"vote\.sync\.any"))}}
    counts["block_loops"] = getattr(compiled, "launch_kwargs", {}).get("BLOCK_LOOPS")
    try:
        sass = sass_offline.cuobjdump(compiled, "-sass")
        usage = sass_offline.cuobjdump(compiled, "-res-usage")
    except (OSError, sass_offline.subprocess.CalledProcessError) as e:
        counts["sass_error"] = str(e)
        continue
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    counts["sass"] = {name: sum(op.startswith(name) for op in ops)
                      for name in ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "USETMAXREG")}
    counts["sass"]["LOCAL"] = int(re.search(r"LOCAL:(\d+)", usage).group(1))
print(json.dumps(result))
"""


# The Gluon kernel's head_dim classes: 128 (one column part as wide as the rows), 64 (three K/V
# stages; taken from 2049 queries on), 96 (two column parts, 64 + 32: every buffer and wgmma
# twice; 80 = 64 + 16 compiles to its code but for constants, 112 pads to 128 as one part),
# 192 (128 + 64 with 64-key blocks) and 256 (64-key blocks; the output staged in Q's buffer:
# buffers of its own do not fit in shared memory); and two head dims between the table's
# (table_config: 72 as 64 + 16 with its last 8 columns read as zeros, 224 as one part of 256)
COMPILED_HEAD_DIMS = (128, 64, 96, 192, 256, 72, 224)
# and its packed-batch variant at every head_dim it takes (PACKED_HEAD_DIMS)
COMPILED_PACKED_HEAD_DIMS = (128, 64, 80, 96, 192, 256)
# and the Gluon backward's dK/dV ("b" + head_dim) and dQ ("bq" + head_dim) kernels at the head
# dims they take (64 in 128-row query blocks and 128-key dQ blocks; both without the causal mask
# at 128: "bn128", "bqn128"; and the dK/dV kernel that adds dQ by the copy engine's reduce-add,
# deterministic=False's: "bd128"; and on bshd views, through 4-D descriptors: "bs128", "bqs128",
# "bds128", "bs64", "bqs64"; with a sliding window and a softcap: "bw128", "bqw128", "bdw128",
# and at 64, whose dK/dV kernel then streams 64-row query blocks, "bw64", "bqw64"; 80, 96 and
# 112 on 128's tiles, their products chained over 64 + 16, 64 + 32 and 64 + 32 + 16 columns)
COMPILED_BWD_HEAD_DIMS = (128, 64, 80, 96, 112)
# and layout_for's layouts by keys ("f{head_dim}k{keys}"): 80 as one padded part, 80 and 96
# with 64-key blocks; 160 on 128-key blocks past WIDE_BLOCK_KEYS (its output staged in Q's buffer)
COMPILED_FEW_KEYS = ("f80k100", "f80k300", "f96k300", "f160k4096")
# and its strided variant ("s{head_dim}"): bshd q/k/v/out, one column part, two, and the output
# staged in Q's buffer
COMPILED_STRIDED = ("s128", "s96", "s256")
# and a dense call whose tiles hold one K/V block each ("o{head_dim}"), which block_loops
# compiles without the block loops at a split head_dim
COMPILED_ONE_BLOCK = ("o96",)
# and a call with a sliding window and a softcap ("w{head_dim}"), whose block loops are the
# dense rule's (two at 64: the left edge's masked blocks, the unmasked, the masked)
COMPILED_WINDOW = ("w64",)
# and head_dim 64 on three consumer warpgroups ("t64": THREE_CONSUMERS, dense calls of many
# tiles)
COMPILED_THREE_CONSUMERS = ("t64",)
# the block loops (block_loops) each of those launches passes: two at 64, 72, 96 and 192, at
# their few-key layouts but 80's padded one, and in packed batches at 64, 80, 96 and 192; one at
# one part of 128 or 256 columns (224 too), packed or not; none where a tile holds one block
BLOCK_LOOPS = {"128": 1, "64": 2, "96": 2, "192": 2, "256": 1, "72": 2, "224": 1, "o96": 0,
               "f80k100": 1, "f80k300": 2, "f96k300": 2, "f160k4096": 2, "s128": 1, "s96": 2,
               "s256": 1, "w64": 2, "t64": 2,
               **{f"p{d}": 1 if d in (128, 256) else 2 for d in COMPILED_PACKED_HEAD_DIMS}}
# the forward kernels whose block loops rescale O lazily (O one part of LAZY_COLUMNS = 128
# columns or more: 128, 256 and 224, and 80's padded few-key layout), each warp voting on its rows
LAZY_RESCALE = {"128", "256", "224", "p128", "p256", "s128", "s256", "f80k100"}


@pytest.fixture(scope="module")
def hopper_compile():
    if gluon_compat.missing():
        pytest.fail(f"Triton {triton.__version__}'s Gluon lacks {gluon_compat.missing()}: the "
                    "Hopper kernel would fall back to the Triton kernel on every H200")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    names = [*map(str, COMPILED_HEAD_DIMS), *(f"p{d}" for d in COMPILED_PACKED_HEAD_DIMS),
             *(f"b{d}" for d in COMPILED_BWD_HEAD_DIMS),
             *(f"bq{d}" for d in COMPILED_BWD_HEAD_DIMS), "bn128", "bqn128", "bd128", "bs128",
             "bqs128", "bds128", "bs64", "bqs64", "bw128", "bqw128", "bdw128", "bw64", "bqw64",
             *COMPILED_FEW_KEYS, *COMPILED_STRIDED, *COMPILED_ONE_BLOCK, *COMPILED_WINDOW,
             *COMPILED_THREE_CONSUMERS]
    # ~46 compiles, ~2 min on one core of the CPU machine with a cold Triton cache (CI's): two
    # processes take half each. The time limit only stops a hang; a busy runner may take 3x.
    runs = [subprocess.Popen([sys.executable, "-c", _COMPILE, str(ROOT / "benchmarks"),
                              *names[i::2]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env) for i in range(2)]
    result = {}
    try:
        for run in runs:
            out, err = run.communicate(timeout=900)
            assert run.returncode == 0, err[-4000:]
            result.update(json.loads(out.strip().splitlines()[-1]))
    finally:
        for run in runs:
            run.kill()
    return result


def test_gluon_api_is_all_there():
    # The names the kernel uses, as chosen for this Triton (3.9 renamed the TMA copies).
    assert gluon_compat.missing() == []
    assert callable(gluon_compat.tma_load) and callable(gluon_compat.tma_store)


def test_hopper_kernel_compiles_for_sm90_with_wgmma_and_tma(hopper_compile):
    # At each of COMPILED_HEAD_DIMS, per consumer warpgroup and K/V block: Q K^T and P V as
    # asynchronous wgmma; the loader's Q, K and V copies through the copy engine, and the
    # epilogue's O store by the copy engine (at 256 staged in Q's buffer);
    # mbarriers between them; a register split between the partitions (setmaxnreg); no local
    # arrays (cuobjdump's LOCAL 0: register spills count as STACK, which some of these kernels
    # have a few dozen bytes of; benchmarks/sass_offline.py reports it). Counts of 3.6's SASS
    # at head_dim 128 (benchmarks/sass_offline.py --gluon --head-dim 128): HGMMA 64, UTMALDG 8,
    # UTMASTG 2; 3.7.1 and 3.9.0 give the same.
    # The packed-batch variant ("p" + head_dim) also takes its tiles from a global counter
    # (an atomic add) and stores blocks inside a sequence by TMA. The dK/dV kernel ("b" +
    # head_dim) has the same parts: its four products as wgmma, Q/dO/K/V by TMA, dK/dV stored by
    # TMA; so does the dQ kernel ("bq" + head_dim), with dQ stored by TMA; the fused one ("bd")
    # adds its dQ tiles by the copy engine's reduce-add, which no other kernel here issues. The
    # few-key layouts ("f...") are the forward's, with their other column parts or key blocks.
    # The strided variants ("s...", and the backward's "bs...", "bqs...") copy through 4-D
    # [batch, heads, seq, head_dim] views, the others through views of fewer dimensions. The
    # forward kernels that rescale O lazily (LAZY_RESCALE) vote across each warp; no other does.
    for head_dim, counts in hopper_compile.items():
        if not head_dim.startswith("b"):  # the forward's: the launch's BLOCK_LOOPS
            assert counts["block_loops"] == BLOCK_LOOPS[head_dim], (head_dim, counts)
        ptx = counts["ptx"]
        assert ptx["wgmma"] > 0 and ptx["tma_load"] > 0, (head_dim, ptx)
        assert (ptx["atomic"] > 0) == head_dim.startswith("p"), (head_dim, ptx)
        assert ptx["tma_store"] > 0, (head_dim, ptx)
        assert ptx["mbarrier"] > 0 and ptx["setmaxnreg"] > 0, (head_dim, ptx)
        assert (ptx["tma_4d"] > 0) == ("s" in head_dim), (head_dim, ptx)
        assert (ptx["tma_reduce"] > 0) == head_dim.startswith("bd"), (head_dim, ptx)
        assert (ptx["vote"] > 0) == (head_dim in LAZY_RESCALE), (head_dim, ptx)
        if "sass" not in counts:
            pytest.skip(f"PTX checked; the wheel's cuobjdump did not run here: "
                        f"{counts['sass_error']}")
        sass = counts["sass"]
        assert sass["HGMMA"] > 0 and sass["UTMALDG"] > 0, (head_dim, sass)
        assert sass["UTMASTG"] > 0, (head_dim, sass)
        assert sass["SYNCS"] > 0 and sass["USETMAXREG"] > 0, (head_dim, sass)
        assert sass["LOCAL"] == 0, f"head_dim {head_dim} uses local arrays: {sass}"


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_direct_launch_passes_what_tritons_runner_passes(monkeypatch):
    # The same launch both ways into a recording launcher: Triton's CudaLauncher (the
    # CompiledKernel's runner) called as CompiledKernel[grid] calls it with no launch hook, and
    # _Bound's direct call. Global scratch is on, as for the kernels that make TMA descriptors
    # on the device.
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime import driver
    assert launch.direct_layout() in ("flat", "packed"), (
        f"Triton {triton.__version__}'s CudaLauncher.__call__ takes an argument list _Bound does "
        "not know: every eager launch takes Triton's slower runner")
    run = object.__new__(CudaLauncher)  # no GPU: set what __init__ would from the metadata
    run.launch = _Recorder()
    run.num_ctas, run.global_scratch_size, run.global_scratch_align = 1, 640, 128
    run.profile_scratch_size, run.profile_scratch_align = 0, 1
    run.launch_cooperative_grid, run.launch_pdl = False, True
    run.arg_annotations, run.kernel_signature = "annotations", "signature"
    run.gsan_enabled = False
    compiled = types.SimpleNamespace(_run=run, function=1234, packed_metadata=("metadata",))
    stream = 77
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: stream,
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    scratch = lambda size, align, s: ("scratch", size, align, s)  # noqa: E731
    triton.set_allocator(scratch)
    # the runner reads triton.runtime.driver.active, which would look for a GPU
    monkeypatch.setattr(driver, "_active", types.SimpleNamespace())
    try:
        grid, args, suffix = (6, 2, 1), (object(), 5), (64, True)  # object(): a tensor
        run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
            *args, *suffix)
        bound = launch._Bound(compiled, grid, suffix)
        assert bound.direct
        bound(args)
    finally:
        triton.set_allocator(launch._NULL_ALLOCATOR)
    expected, direct = run.launch.calls
    assert direct[:4] == (6, 2, 1, stream) and len(direct) == len(expected)
    for got, want in zip(direct, expected):
        assert got is want or got == want, (direct, expected)


def test_direct_launch_reads_the_runner_tritons_compiled_kernel_makes():
    # What _Bound takes from a CompiledKernel: its runner (`_run`, made on first launch, the
    # driver's launcher class), `function` and `packed_metadata`, and the runner's parameters
    # (CompiledKernel[grid] passes the packed metadata right after the function).
    from triton.compiler.compiler import CompiledKernel
    source = _source(CompiledKernel.__getitem__)
    assert re.search(r"self\.run\(grid\[0\], grid\[1\], grid\[2\], stream, self\.function, "
                     r"self\.packed_metadata, launch_metadata,", source), source
    assert "self._run = driver.active.launcher_cls(" in _source(CompiledKernel)


def _source(obj):
    return re.sub(r"\s+", " ", inspect.getsource(obj))  # one line: calls wrap differently


def test_a_triton_without_the_gluon_api_falls_back_with_one_warning(monkeypatch):
    # Where Gluon lacks a name the kernel uses, the dispatch keeps the Triton kernel and says
    # once, naming what is missing, instead of failing at the kernel's first compile.
    import warnings
    monkeypatch.setattr(gluon_compat, "missing", lambda: ["tma.async_load"])
    dispatch._hopper.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"lacks tma\.async_load.*falls back"):
            assert dispatch._hopper() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dispatch._hopper() is None  # decided once per process: no second warning
    finally:
        dispatch._hopper.cache_clear()
