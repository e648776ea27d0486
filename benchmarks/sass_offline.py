"""Compile the fused forward for Hopper (sm_90) on a machine without a GPU and read its SASS.

Triton compiles for a named target without a driver, and its wheel ships ptxas and cuobjdump, so
registers, spills, shared memory, the instruction mix and ptxas's performance remarks of any
config can be checked before spending device time (notes/forward.md, "Checking a kernel
without a GPU"). Use the Triton version the GPU machine has (3.6.0 on the H200), e.g. in a side
venv; the code generated differs by version.

    python benchmarks/sass_offline.py --head-dim 128 --config 128,64,8,3 [--pipeline] [--tma]
        [--maxnreg N] [--sass out.sass]
    python benchmarks/sass_offline.py --gluon --head-dim 128 [--config 128,2,240,2]

--gluon compiles the Hopper kernel (attention_fwd_hopper.py) instead; its --config is that module's
CONFIG_FIELDS (default: what a launch at --head-dim and --keys takes, layout_for's; --no-lse: as an
inference call that returns no LSE compiles it). --loops lists the kernel's loops with their
instruction counts (a consumer's block loop: the shortest with HGMMA). --gluon-bwd and
--gluon-bwd-dq compile the Gluon backward's dK/dV and dQ kernels (attention_bwd_hopper.py) at its
table's config (head_dim 128 by default; any of its TILE's; --config does not apply).
--triton-bwd dkdv|dq compiles the Triton backward's kernels (attention_bwd.py) at a config of its
CONFIG_FIELDS (default: its table's entry for --head-dim), --kv-heads K/V heads of 4 query heads.
--decode compiles the split-KV decode kernel (attention_decode.py) as the op launches it for 32
query heads on 8 K/V heads, one query, 8192 keys (--page-size N: on a paged cache of N-key
pages); its --config is BLOCK_M,BLOCK_N,num_warps,num_stages (default: config_for's).
"""
import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import types

# The package turns the interpreter on where no GPU is; an explicit 0 keeps the kernels compiled.
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

COUNTED = ("HGMMA", "WARPGROUP", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "LDGSTS",
           "UTMALDG", "UTMASTG", "SYNCS", "BAR", "USETMAXREG", "LDL", "STL", "LDS", "STS", "SHFL")


def _launch_options():
    # the compile options every eager launch passes (attnscope.kernels.launch), so the offline
    # kernels are the launched ones (imported late: _offline_driver comes first)
    from attnscope.kernels.launch import COMPILE_OPTIONS
    return COMPILE_OPTIONS


def compile_fwd(head_dim, config, pipeline, tma, maxnreg, dtype="bf16"):
    """The CompiledKernel of _attn_fwd for sm_90, specialised as a contiguous launch would be."""
    from attnscope.kernels.attention_fwd import _attn_fwd as fn
    block_m, block_n, num_warps, num_stages = config
    unit_strides = {"stride_qk", "stride_kk", "stride_vk", "stride_ok"}
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr or name in unit_strides:
            signature[name] = "constexpr"
            if name in unit_strides:
                constants[name] = 1
        elif name.startswith("CU_SEQLENS"):  # packed sequences only: None otherwise
            signature[name] = "constexpr"
            constants[name] = None
        elif name in ("Q", "K", "V", "Out", "Lse"):
            signature[name] = "*fp32" if name == "Lse" else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "softcap_log2"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    constants.update(HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                     CAUSAL=True, INPUT_PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=block_n,
                     PIPELINE=pipeline, USE_TMA=tma, EVEN_N=True, EMPTY_ROWS=False,
                     HAS_WINDOW=False, SOFTCAP=False, VARLEN=False, STORE_LSE=True)
    options = dict(num_warps=num_warps, num_stages=num_stages, **_launch_options())
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(ASTSource(fn, signature, constants, attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def _offline_driver():
    """A driver that names the sm_90 target instead of asking a GPU, and the Gluon modules'
    device lookups answered as an H200's."""
    import torch
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    class Offline(CudaDriver):
        def __init__(self):  # no libcuda here: nothing to load
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Offline())
    from attnscope.kernels import attention_bwd_hopper, attention_fwd_hopper, common
    h200 = types.SimpleNamespace(major=9, multi_processor_count=132, L2_cache_size=60 << 20)
    for module in (attention_fwd_hopper, attention_bwd_hopper, common):
        module.device_properties = lambda device: h200


def compile_gluon(head_dim, config, dtype="bf16", varlen=False, parts=None, bshd=False,
                  keys=1024, window=(-1, -1), softcap=0.0, lse=True):
    """The CompiledKernel of the Gluon kernel for sm_90, through the module's own launch helper
    (so descriptors, grid and constants are the ones a launch uses) with the launch replaced by
    a warm-up compile (_offline_driver). `config`: CONFIG_FIELDS, or None for the launch's own
    choice (layout_for's, three_consumers'). `varlen`: the packed-sequence (VARLEN) kernel, as
    fused_attention_varlen launches it; `parts`: column parts (D0, D1) instead of layout_for's
    (a dense call of 1024 keys: column_parts'); `bshd`: a dense call of [batch, seq, heads,
    head_dim] tensors, which the kernel views at their strides (STRIDED); `keys`: a dense call's
    query and key length (at most one K/V block: no block loop where block_loops says so);
    `window` and `softcap`: a causal call's, as fused_attention takes them; lse=False: an
    inference call that returns no LSE (the kernel stores none)."""
    import torch
    _offline_driver()
    from attnscope.kernels import attention_fwd_hopper as module
    kernel = module._attn_fwd_hopper

    def compile_only(key, grid, args, kwargs, **_):
        compiled = kernel.warmup(*args, grid=grid, **kwargs, **_launch_options())
        compiled.launch_kwargs = kwargs  # what the launch passed (tests read BLOCK_LOOPS)
        return compiled
    module._launch = module._launch_packed = compile_only
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    if varlen:  # two sequences packed into 1024 rows, viewed as the varlen op views them
        packed = torch.empty(1024, 4, head_dim, dtype=torch_dtype).permute(1, 0, 2)
        q = packed.unsqueeze(0).expand(2, -1, -1, -1)
        cu = torch.tensor([0, 300, 1024], dtype=torch.int32)
        return module.attention_fwd_hopper(q, q, q, torch.empty_like(q), torch.empty(4, 1024),
                                           causal=True, scale=head_dim ** -0.5, causal_offset=0,
                                           window=window, softcap=softcap,
                                           varlen=(cu, cu, 724, 724), config=config,
                                           parts=parts)
    if bshd:
        q = torch.empty(2, keys, 4, head_dim, dtype=torch_dtype).transpose(1, 2)
    else:
        q = torch.empty(2, 4, keys, head_dim, dtype=torch_dtype)
    return module.attention_fwd_hopper(q, q, q, torch.empty_like(q),
                                       torch.empty(2, 4, keys) if lse else None, causal=True,
                                       scale=head_dim ** -0.5, causal_offset=0,
                                       window=window, softcap=softcap, config=config,
                                       parts=parts)


def compile_gluon_bwd(head_dim, dtype="bf16", dq=False, causal=True, fused_dq=False,
                      bshd=False, window=(-1, -1), softcap=0.0):
    """The CompiledKernel of the Gluon dK/dV kernel (attention_bwd_hopper.py; with dq, its dQ
    kernel; with fused_dq, the dK/dV kernel that adds dQ too) for sm_90, as compile_gluon
    compiles the forward: 2 x 4 query heads on 2 K/V heads (4 with fused_dq, which takes no
    GQA), 1024 keys, causal unless said; `bshd`: every tensor a [batch, seq, heads, head_dim]
    view, which the kernels read at their strides (STRIDED); `window` and `softcap` as
    fused_attention takes them."""
    import torch
    _offline_driver()
    from attnscope.kernels import attention_bwd_hopper as module
    from attnscope.kernels.common import visibility
    for name, kernel in (("_launch", module._attn_bwd_dkdv_hopper),
                         ("_launch_dq", module._attn_bwd_dq_hopper)):
        setattr(module, name, lambda key, grid, args, kwargs, kernel=kernel, **_:
                kernel.warmup(*args, grid=grid, **kwargs, **_launch_options()))
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16

    def tensor(heads):
        if bshd:
            return torch.empty(2, 1024, heads, head_dim, dtype=torch_dtype).transpose(1, 2)
        return torch.empty(2, heads, 1024, head_dim, dtype=torch_dtype)
    q = tensor(4)
    k = tensor(4 if fused_dq else 2)
    lse = torch.empty(2, 4, 1024)
    bounded, offset, has_window, left_offset = visibility(causal, 0, window)
    kw = dict(causal=bounded, scale=head_dim ** -0.5, causal_offset=offset, softcap=softcap,
              left_offset=left_offset if has_window else None)
    if fused_dq:
        kw["dq_acc"] = torch.empty(q.shape)
    if dq:
        return module.attention_bwd_dq_hopper(q, k, k, q, torch.empty_like(q), lse, lse, **kw)
    return module.attention_bwd_dkdv_hopper(q, k, k, q, torch.empty_like(k), torch.empty_like(k),
                                            lse, lse, **kw)


def compile_triton_bwd(head_dim, config, which, dtype="bf16", kv_heads=2):
    """The CompiledKernel of the Triton backward's dK/dV or dQ kernel (attention_bwd.py, `which`
    "dkdv" or "dq") for sm_90, through attention_bwd's own argument building (its `wrap` hook
    compiles instead of launching): 2 x 4 query heads on kv_heads K/V heads, 1024 keys, causal;
    `config` a tuple named by attention_bwd.CONFIG_FIELDS (None: its table's)."""
    import torch
    _offline_driver()
    from attnscope.kernels import attention_bwd as module
    compiled = {}

    class Warm:  # wrap(kernel)[grid](*args, **kwargs) compiles kernel as that launch would
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def warm(*args, **kwargs):
                compiled[self.kernel] = self.kernel.warmup(*args, grid=grid, **kwargs,
                                                           **_launch_options())
            return warm
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    q = torch.empty(2, 4, 1024, head_dim, dtype=torch_dtype)
    k = torch.empty(2, kv_heads, 1024, head_dim, dtype=torch_dtype)
    lse = torch.empty(2, 4, 1024)
    module.attention_bwd(q, q, k, k, q, lse, torch.empty_like(q), torch.empty_like(k),
                         torch.empty_like(k), torch.empty_like(lse), causal=True,
                         scale=head_dim ** -0.5, causal_offset=0, config=config, wrap=Warm)
    return compiled[module._attn_bwd_dkdv if which == "dkdv" else module._attn_bwd_dq]


def compile_decode(head_dim, config, dtype="bf16", page_size=None, num_splits=None):
    """The CompiledKernel of the decode split kernel (attention_decode._decode_split) for sm_90,
    through attention_decode's own launch (so its split rule, constexprs and tiles are a
    launch's): 4 sequences x 32 query heads on 8 K/V heads, one query, 8192 keys, contiguous or
    on a paged cache of page_size-key pages; num_splits: that many splits (the kernel that
    merges them) instead of the rule's count for an offline device."""
    import torch
    _offline_driver()
    from attnscope.kernels import attention_decode as module
    compiled = []

    class Offline:  # stands in for launch.FastLaunch: compiles `kernel`, launches nothing
        bound = {}

        def __init__(self, kernel=None):
            self.kernel = kernel

        def __call__(self, key, grid, args, kwargs, **_):
            if self.kernel is not None:
                compiled.append(self.kernel.warmup(*args, grid=grid, **kwargs,
                                                   **_launch_options()))
    module._split_launch = Offline(module._decode_split)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    batch, kv_len = 4, 8192
    q = torch.empty(batch, 32, 1, head_dim, dtype=torch_dtype)
    kw = {}
    if page_size:
        pages = kv_len // page_size
        k = torch.empty(batch * pages, page_size, 8, head_dim, dtype=torch_dtype)
        kw["block_table"] = torch.arange(batch * pages, dtype=torch.int32).reshape(batch, pages)
    else:
        k = torch.empty(batch, 8, kv_len, head_dim, dtype=torch_dtype)
    module.attention_decode(q, k, k, torch.empty_like(q), torch.empty(batch, 32, 1), causal=True,
                            scale=head_dim ** -0.5, config=config, num_splits=num_splits, **kw)
    return compiled[0]


def cuobjdump(compiled, *flags):
    exe = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([exe, *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def ptxas_advice(compiled):
    """ptxas's own performance remarks on the PTX (e.g. C7515: wgmma serialized because other
    instructions write the accumulator registers mid-pipeline), which Triton's build discards."""
    # the ptxas Triton itself runs for sm_90: 3.9 takes its newer one (its PTX needs it)
    from triton.backends.nvidia.compiler import get_ptxas
    exe = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        ptx = pathlib.Path(tmp, "k.ptx")
        ptx.write_text(compiled.asm["ptx"])
        run = subprocess.run([exe, "-arch=sm_90a", "-v", str(ptx),
                              "-o", str(ptx.with_suffix(".o"))], capture_output=True, text=True)
    return [line.strip() for line in (run.stdout + run.stderr).splitlines()
            if "Performance" in line or "error" in line.lower()]


LOOP_COUNTED = ("BAR.SYNC", "SYNCS", "HGMMA", "FMUL", "LDL", "STL")


def loops(sass, min_len=32):
    """The SASS listing's loops, innermost (shortest) first: (first address, branch address,
    instructions, {op: count}) for each backward branch over at least min_len instructions.
    Counts are of the loop body as written, both sides of any branch inside it."""
    ins = [(int(a, 16), text) for a, text in
           re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass, re.M)]
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (a, text) in enumerate(ins):
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        target = int(branch.group(1), 16) if branch else None
        if target is not None and target < a and target in index:
            body = [t for _, t in ins[index[target]:i + 1]]
            if len(body) >= min_len:
                counts = {op: sum(bool(re.search(r"\b" + re.escape(op), t)) for t in body)
                          for op in LOOP_COUNTED}
                found.append((target, a, len(body), counts))
    return sorted(found, key=lambda loop: loop[2])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--head-dim", type=int, default=None,
                   help="HEAD_DIM (default 64; 128 with --gluon-bwd / --gluon-bwd-dq)")
    p.add_argument("--config", default=None,
                   help="BLOCK_M,BLOCK_N,num_warps,num_stages (default 128,64,8,3, the "
                        "long-sequence entry; causal head_dim-64 calls of <= 2048 queries run "
                        "64,64,4,3); with --gluon BLOCK_N,STAGES,REGS,CONSUMERS")
    p.add_argument("--gluon", action="store_true", help="the Gluon Hopper kernel instead")
    p.add_argument("--gluon-bwd", action="store_true",
                   help="the Gluon dK/dV backward kernel (attention_bwd_hopper.py) instead")
    p.add_argument("--gluon-bwd-dq", action="store_true",
                   help="the Gluon dQ backward kernel (attention_bwd_hopper.py) instead")
    p.add_argument("--fused-dq", action="store_true",
                   help="with --gluon-bwd: the dK/dV kernel that adds dQ too "
                        "(attention_bwd's deterministic=False)")
    p.add_argument("--triton-bwd", choices=["dkdv", "dq"], default=None,
                   help="the Triton backward's dK/dV or dQ kernel (attention_bwd.py) instead; "
                        "--config: its CONFIG_FIELDS, 8 values (default: its table's)")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="with --triton-bwd: K/V heads of the 4 query heads (4: no GQA)")
    p.add_argument("--decode", action="store_true",
                   help="the split-KV decode kernel (attention_decode.py) instead")
    p.add_argument("--page-size", type=int, default=None,
                   help="with --decode: on a paged cache of this many keys a page")
    p.add_argument("--splits", type=int, default=None,
                   help="with --decode: that many key splits (2 or more: the kernel that merges "
                        "its partials), not the split rule's count")
    p.add_argument("--varlen", action="store_true",
                   help="with --gluon: its packed-sequence variant (fused_attention_varlen's)")
    p.add_argument("--bshd", action="store_true",
                   help="with --gluon, --gluon-bwd or --gluon-bwd-dq: a dense call of bshd "
                        "tensors, viewed at their strides")
    p.add_argument("--keys", type=int, default=None,
                   help="with --gluon: a dense call of this many queries and keys (default 1024; "
                        "e.g. 128, one K/V block a tile: no block loop where block_loops says "
                        "so)")
    p.add_argument("--window", default=None,
                   help="with --gluon, --gluon-bwd or --gluon-bwd-dq: a sliding window "
                        "LEFT,RIGHT (fused_attention's window; the call is causal, so RIGHT "
                        "is 0), e.g. 256,0")
    p.add_argument("--softcap", type=float, default=0.0,
                   help="with --gluon, --gluon-bwd or --gluon-bwd-dq: a softcap (logits "
                        "softcap * tanh(s / softcap)), e.g. 50")
    p.add_argument("--no-lse", action="store_true",
                   help="with --gluon: a dense inference call that returns no LSE (the kernel's "
                        "STORE_LSE off)")
    p.add_argument("--pipeline", action="store_true", help="the software-pipelined loop")
    p.add_argument("--tma", action="store_true", help="K/V through tensor descriptors")
    p.add_argument("--maxnreg", type=int, default=None, help="register cap per thread")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="input dtype")
    p.add_argument("--parts", default=None,
                   help="with --gluon: column parts D0,D1 instead of the layout a 1024-key call "
                        "gets (e.g. 128,0: head_dim 80 as one part padded to 128 columns)")
    p.add_argument("--sass", default=None, help="also write the SASS listing here")
    p.add_argument("--loops", action="store_true",
                   help="also list the loops (backward branches over 32 or more instructions), "
                        "shortest first, with their instructions and "
                        + ", ".join(LOOP_COUNTED) + "; a consumer's block loop is the "
                        "shortest with HGMMA (each consumer partition has its own copy), the "
                        "tile loops around it come later")
    args = p.parse_args()
    if args.parts and not args.gluon:
        p.error("--parts goes with --gluon")
    if args.bshd and (not (args.gluon or args.gluon_bwd or args.gluon_bwd_dq) or args.varlen):
        p.error("--bshd goes with --gluon, --gluon-bwd or --gluon-bwd-dq, without --varlen")
    if args.keys is not None and (not args.gluon or args.varlen):
        p.error("--keys goes with --gluon, without --varlen")
    if args.no_lse and (not args.gluon or args.varlen):
        p.error("--no-lse goes with --gluon, without --varlen")
    if args.keys is not None and args.keys < 1:
        p.error(f"--keys must be positive, got {args.keys}")
    if (args.window or args.softcap) and not (args.gluon or args.gluon_bwd or args.gluon_bwd_dq):
        p.error("--window and --softcap go with --gluon, --gluon-bwd or --gluon-bwd-dq")
    if args.window and not re.fullmatch(r"-?\d+,-?\d+", args.window):
        p.error(f"--window takes LEFT,RIGHT (e.g. 256,0), got {args.window!r}")
    if args.softcap < 0:
        p.error(f"--softcap must be positive (0: none), got {args.softcap}")
    if args.parts and not re.fullmatch(r"\d+,\d+", args.parts):
        p.error(f"--parts takes D0,D1 (e.g. 128,0), got {args.parts!r}")
    if args.fused_dq and not args.gluon_bwd:
        p.error("--fused-dq goes with --gluon-bwd")
    bwd = args.gluon_bwd or args.gluon_bwd_dq
    if args.head_dim is None:
        args.head_dim = 128 if bwd else 64
    if bwd:
        from attnscope.kernels import attention_bwd_hopper
        if args.head_dim not in attention_bwd_hopper.TILE:
            p.error(f"the Gluon backward takes head_dim {sorted(attention_bwd_hopper.TILE)}")
        if args.fused_dq and not attention_bwd_hopper.fuses_dq(args.head_dim):
            p.error(f"--fused-dq: the fused dQ kernel does not take head_dim {args.head_dim}")
        if args.config:
            p.error("--config does not apply to --gluon-bwd / --gluon-bwd-dq")
        config = None
        window = tuple(int(x) for x in args.window.split(",")) if args.window else (-1, -1)
        compiled = compile_gluon_bwd(args.head_dim, args.dtype, dq=args.gluon_bwd_dq,
                                     fused_dq=args.fused_dq, bshd=args.bshd, window=window,
                                     softcap=args.softcap)
    elif args.triton_bwd:
        from attnscope.kernels import attention_bwd
        config = args.config and tuple(int(x) for x in args.config.split(","))
        if config and len(config) != len(attention_bwd.CONFIG_FIELDS):
            p.error(f"--triton-bwd --config takes {','.join(attention_bwd.CONFIG_FIELDS)}")
        if args.kv_heads < 1 or 4 % args.kv_heads:
            p.error("--kv-heads must divide the 4 query heads")
        compiled = compile_triton_bwd(args.head_dim, config, args.triton_bwd, args.dtype,
                                      args.kv_heads)
    elif args.decode:
        config = args.config and tuple(int(x) for x in args.config.split(","))
        if config and len(config) != 4:
            p.error("--decode --config takes BLOCK_M,BLOCK_N,num_warps,num_stages")
        compiled = compile_decode(args.head_dim, config, args.dtype, args.page_size, args.splits)
    elif args.gluon:
        config = args.config and tuple(int(x) for x in args.config.split(","))
        if config and len(config) != 4:
            p.error("--gluon --config takes BLOCK_N,STAGES,REGS,CONSUMERS")
        parts = args.parts and tuple(int(x) for x in args.parts.split(","))
        window = tuple(int(x) for x in args.window.split(",")) if args.window else (-1, -1)
        compiled = compile_gluon(args.head_dim, config, args.dtype, args.varlen, parts,
                                 args.bshd, args.keys or 1024, window, args.softcap,
                                 not args.no_lse)
    else:
        config = tuple(int(x) for x in (args.config or "128,64,8,3").split(","))
        if len(config) != 4:
            p.error("--config takes BLOCK_M,BLOCK_N,num_warps,num_stages")
        compiled = compile_fwd(args.head_dim, config, args.pipeline, args.tma, args.maxnreg,
                               args.dtype)
    usage = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", cuobjdump(compiled, "-res-usage"))
    sass = cuobjdump(compiled, "-sass")
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
    kind = ("gluon dQ" if args.gluon_bwd_dq else "gluon dK/dV + dQ" if args.fused_dq
            else "gluon dK/dV" if args.gluon_bwd
            else f"triton backward {args.triton_bwd} (kv_heads {args.kv_heads} of 4)"
            if args.triton_bwd
            else "gluon" if args.gluon else "decode" if args.decode else "triton")
    print(f"triton {triton.__version__}, sm_90, {kind} kernel, "
          f"head_dim {args.head_dim}, config {config or 'of the launch'}"
          + (", packed sequences" if args.varlen else "")
          + (f", column parts {args.parts}" if args.parts else "")
          + (f", page size {args.page_size}" if args.page_size else "")
          + ("" if args.gluon or args.gluon_bwd or args.gluon_bwd_dq or args.decode
             or args.triton_bwd
             else f", pipeline {args.pipeline}, tma {args.tma}, "
             f"maxnreg {args.maxnreg}"))
    print(f"{usage.group(0) if usage else 'resource usage not found'}, "
          f"shared memory requested {compiled.metadata.shared} B, {len(ops)} instructions")
    print("  ".join(f"{op} {sum(o.startswith(op) for o in ops)}" for op in COUNTED))
    print("\n".join(ptxas_advice(compiled)) or "ptxas: no performance remarks")
    for start, end, n, counts in loops(sass) if args.loops else ():
        print(f"loop {start:#x}-{end:#x}: {n} instructions, "
              + ", ".join(f"{op} {c}" for op, c in counts.items()))
    if args.sass:
        pathlib.Path(args.sass).write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
