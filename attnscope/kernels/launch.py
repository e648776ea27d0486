"""The launch cache and direct launcher every kernel's eager launch goes through.

Triton's `kernel[grid](*args)` binds the arguments, works out their specialization (dtypes,
which integers are 1 or multiples of 16, pointer alignment) and looks the compiled kernel up on
every call: ~40 of the ~60 us a launch took on the H200's host (notes/launch.md),
more than the seed-shape kernel itself. `FastLaunch` does that once per key and keeps a `_Bound`
launch, which calls Triton's C launcher for the kernel directly.

That direct call relies on Triton internals: the positional argument layout of the NVIDIA
backend's launcher (two layouts known: Triton 3.6's, and 3.7 to 3.9's) and where Triton keeps
the calling thread's scratch allocator. It is used only where the installed Triton has one of
the shapes it was written for (`direct_layout`);
elsewhere every call takes Triton's public launch, after one warning saying what that costs.

Every FastLaunch (and every `launch_table`) registers itself here, so `forget_launches()` drops
every kept launch without importing a kernel module; `launched()` lists the compiled kernels the launches ran.
"""

import functools
import inspect
import itertools
import re
import warnings

import torch

import triton

try:  # where Triton keeps the calling thread's allocator (3.6 and 3.9 checked)
    from triton.runtime._allocation import _NULL_ALLOCATOR, _allocator as _thread_allocator
except ImportError:  # another layout: set ours before every launch that needs one
    _NULL_ALLOCATOR = _thread_allocator = None

# How Triton's CudaLauncher (a compiled kernel's runner) calls its C launcher, by layout:
# "flat" (3.6: a launcher generated per signature takes the grid, stream, function, its two launch
# flags, global and profile scratch, then CompiledKernel's run arguments -- packed metadata,
# launch metadata, the two launch hooks -- and the kernel's arguments spread out) and "packed"
# (3.7 to 3.9: one generic launcher takes the grid, stream, function, the two flags, the run
# arguments, global and profile scratch, the runner's argument annotations and kernel signature,
# then the kernel's arguments as one tuple). Each is recognised by the runner's parameters and
# the call in its source, so a Triton that changes either takes the public launch.
_FLAGS = "self.launch_cooperative_grid, self.launch_pdl"
_LAYOUTS = {
    "flat": (("self", "gridX", "gridY", "gridZ", "stream", "function", "args"),
             re.escape(f"self.launch(gridX, gridY, gridZ, stream, function, {_FLAGS}, "
                       "global_scratch, profile_scratch, *args)")),
    "packed": (("self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata",
                "launch_metadata", "launch_enter_hook", "launch_exit_hook", "args"),
               re.escape(f"self.launch(gridX, gridY, gridZ, stream, function, {_FLAGS}, "
                         "kernel_metadata, launch_metadata, launch_enter_hook, "
                         "launch_exit_hook, global_scratch, profile_scratch, "
                         "self.arg_annotations, self.kernel_signature, ") + r"(kernel_)?args\)"),
}
# What a compiled kernel and its launcher must carry for the direct call.
_COMPILED_ATTRS = ("function", "packed_metadata")
_RUN_ATTRS = ("launch", "num_ctas", "global_scratch_size", "global_scratch_align",
              "profile_scratch_size", "launch_cooperative_grid", "launch_pdl")
_PACKED_RUN_ATTRS = ("arg_annotations", "kernel_signature")


def launcher_layout(launcher_cls):
    """"flat" or "packed" when `launcher_cls.__call__` takes the grid, stream, function and the
    run's arguments and hands them to its C launcher in a layout the direct launcher reproduces
    (read from its signature and source); None otherwise."""
    call = getattr(launcher_cls, "__call__", None)
    try:
        params = tuple(inspect.signature(call).parameters.values())
        source = re.sub(r"\s+", " ", inspect.getsource(call)).replace("( ", "(")
    except (TypeError, ValueError, OSError):  # a builtin or no source: cannot be read
        return None
    names = tuple(p.name for p in params)
    for layout, (expected, call_pattern) in _LAYOUTS.items():
        if (names == expected and params[-1].kind is inspect.Parameter.VAR_POSITIONAL
                and re.search(call_pattern, source)):
            return layout
    return None


@functools.cache
def direct_layout():
    """The installed Triton's launcher layout when the direct launcher fits it and the thread's
    scratch allocator can be read, else None; checked once per process."""
    if _thread_allocator is None:
        return None
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except Exception:  # no NVIDIA backend in this Triton build
        return None
    return launcher_layout(CudaLauncher)


def direct_launch_ok():
    """True when repeats can call the installed Triton's launcher directly (`direct_layout`)."""
    return direct_layout() is not None


def _warn_public_launch():
    # Once per process (the `once` filter keys on the message and the calling location).
    warnings.warn("attnscope: this Triton's kernel launcher is not one the direct launcher "
                  "was written for (Triton 3.6 to 3.9's); every launch goes through Triton's "
                  "public launch, which costs ~40 us more host time per call (notes/launch.md)",
                  RuntimeWarning, stacklevel=3)


_warned = False


def _scratch(size, alignment, stream):
    # Device-side tensor descriptors are written to global scratch memory Triton asks for here,
    # on the current device (the op makes the inputs' device current before it launches).
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator():
    """Give Triton the allocator that kernels making tensor descriptors on the device need.
    Triton keeps it per thread (a ContextVar), so this checks the calling thread's own: a launch
    from autograd's device thread (activation checkpointing), a DataParallel replica or a thread
    pool needs one too. An allocator the user set is kept."""
    if _thread_allocator is None or _thread_allocator.get() is _NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


_instances = []  # every FastLaunch, for forget_launches
_clock = itertools.count()  # orders the records below by last use
# The compiled kernels the launches ran, by id: [last use, name, compiled kernel, config].
_launched = {}
# Eager launches of either forward kernel, by the dispatch's key: the dispatch looks a call up
# before it knows which kernel runs it, so the two forward FastLaunches share this dict.
FORWARD_LAUNCHES = {}


@functools.lru_cache(maxsize=4096)
def int_specializations(*values):
    """What Triton specializes each of these int arguments on, for keys of launches that pass
    them per call: 1 becomes a constant, a multiple of 16 (0 included) gets a divisibility hint,
    and a value outside int32 a 64-bit parameter. Two values with the same specialization run the
    same compiled kernel. Remembered per argument tuple: a decode step asks for its K/V strides'
    every call (0.09 against 1.3 us for nine strides on the CPU machine)."""
    return tuple(1 if x == 1 else (x % 16 == 0, -0x80000000 <= x <= 0x7FFFFFFF) for x in values)


_tables = []  # per-key tables kept beside the launches (decode's plans), for forget_launches


def launch_table():
    """A dict of what a module keeps per launch key besides the launch itself: forget_launches
    clears it with the kept launches."""
    table = {}
    _tables.append(table)
    return table


def _note(name, compiled, config):
    record = _launched.get(id(compiled))
    if record is None or record[2] is not compiled:
        record = _launched[id(compiled)] = [0, name, compiled, config]
    record[0] = next(_clock)
    return record


def launched():
    """(kernel name, compiled kernel, config) of every kernel the eager launches ran in this
    process, the most recently used first. Empty in the interpreter (it compiles nothing)."""
    records = sorted(_launched.values(), key=lambda r: r[0], reverse=True)
    return [(name, compiled, config) for _, name, compiled, config in records]


# Compile options every eager launch passes. Fused multiply-adds on: the kernels fold the
# softmax's scale and max subtraction into one FMA a score, and were measured so. Triton 3.9
# takes them on by default but warns that 3.10 turns the default off; naming the option keeps
# the kernels as measured on every release (torch.compile's launches take Inductor's options).
COMPILE_OPTIONS = {"enable_fp_fusion": True}


class FastLaunch:
    """`kernel[grid](*args, **kwargs)` with Triton's per-call dispatch done once per key.

    The first launch under a key goes through Triton's; later ones are `_Bound` launches of the
    compiled kernel. So `key` must determine everything Triton specializes on, and every
    argument from `per_call` on: callers build it from the device, dtype, shapes, strides,
    pointer alignment, constexprs, options and those arguments. Where the direct launcher does
    not fit the installed Triton (`direct_launch_ok`), and in the interpreter, every call takes
    the ordinary launch. `bound` may be a dict shared by several kernels whose callers' keys
    never coincide (FORWARD_LAUNCHES)."""

    MAX_KEYS = 256  # a process that launches ever new shapes keeps at most this many

    def __init__(self, kernel, bound=None):
        self.kernel = kernel
        self.name = getattr(getattr(kernel, "fn", None), "__name__", None)
        self.bound = {} if bound is None else bound
        self.jit = isinstance(kernel, triton.runtime.JITFunction)
        _instances.append(self)

    @property
    def enabled(self):
        """Whether repeats of a key skip Triton's dispatch."""
        return self.jit and direct_launch_ok()

    def __call__(self, key, grid, args, kwargs, per_call=None, config=None):
        bound = self.bound.get(key)
        if bound is not None:
            return bound(args[:per_call])
        compiled = self.kernel[grid](*args, **kwargs, **COMPILE_OPTIONS)
        if compiled is None or not self.jit:  # a cache hook stopped it, or the interpreter
            return compiled
        record = _note(self.name, compiled, config)
        if not direct_launch_ok():
            global _warned
            if not _warned:
                _warned = True
                _warn_public_launch()
            return compiled
        if len(self.bound) >= self.MAX_KEYS:
            self.bound.clear()
        # The compiled kernel takes every parameter in order, constexprs included (its
        # launcher skips them).
        constexprs = [kwargs[name] for name in self.kernel.arg_names[len(args):]]
        fixed = args[per_call:] if per_call is not None else ()
        self.bound[key] = _Bound(compiled, grid, (*fixed, *constexprs), record)
        return compiled


def _hooked(hook):
    # Triton 3.6 keeps launch hooks in a HookChain (empty: none); older code assigns a function.
    return hook is not None and bool(getattr(hook, "calls", True))


class _Bound:
    """One compiled kernel, its grid and its trailing arguments fixed: a call passes the rest.

    It calls Triton's C launcher itself (in `direct_layout`'s argument order), with the
    current stream and global scratch as Triton's `CompiledKernel[grid]` runner would find
    them, minus that runner's per-call work (a closure, the device lookup, launch metadata and
    calls of empty hook chains). A launch with Triton's launch hooks set (a profiler such as
    proton), profile scratch or the global sanitizer takes Triton's own runner, as does a
    compiled kernel without the attributes the direct call reads (tests' stand-ins)."""

    def __init__(self, compiled, grid, suffix, record=None):
        self.compiled, self.grid, self.suffix = compiled, (*grid, 1, 1)[:3], suffix
        self.record = record if record is not None else [0]
        run = getattr(compiled, "_run", None)  # the CudaLauncher, made by the first launch
        self.packed = direct_layout() == "packed"
        self.direct = (all(hasattr(compiled, a) for a in _COMPILED_ATTRS)
                       and all(hasattr(run, a) for a in _RUN_ATTRS)
                       and (not self.packed or all(hasattr(run, a) for a in _PACKED_RUN_ATTRS))
                       and run.profile_scratch_size == 0
                       and not getattr(run, "gsan_enabled", False))  # 3.9's global sanitizer
        if self.direct:
            gx, gy, gz = self.grid
            self.scratch = gx * gy * gz * run.num_ctas * run.global_scratch_size
            self.scratch_align = run.global_scratch_align
            self.head = (run.launch, compiled.function, run.launch_cooperative_grid,
                         run.launch_pdl, compiled.packed_metadata)
            if self.packed:
                self.signature = (run.arg_annotations, run.kernel_signature)

    def __call__(self, args):
        self.record[0] = next(_clock)  # for launched(): which kernel ran last
        runtime = triton.knobs.runtime
        if (not self.direct or _hooked(runtime.launch_enter_hook)
                or _hooked(runtime.launch_exit_hook)):
            ensure_scratch_allocator()  # as the first launch had (this thread may be new)
            self.compiled[self.grid](*args, *self.suffix)
            return self.compiled
        launch, function, cooperative, pdl, metadata = self.head
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        scratch = None
        if self.scratch:
            ensure_scratch_allocator()
            scratch = _thread_allocator.get()(self.scratch, self.scratch_align, stream)
        if self.packed:
            launch(*self.grid, stream, function, cooperative, pdl, metadata, None, None, None,
                   scratch, None, *self.signature, (*args, *self.suffix))
        else:
            launch(*self.grid, stream, function, cooperative, pdl, scratch, None, metadata, None,
                   None, None, *args, *self.suffix)
        return self.compiled


def forget_launches():
    """Drop every kept eager launch (forward and backward) and the launched-kernel records:
    tests and labs call it to start from a process that has launched nothing."""
    for launch in _instances:
        launch.bound.clear()
    for table in _tables:
        table.clear()
    _launched.clear()
