"""The launch cache and direct launcher (attnscope/kernels/launch.py): Triton's dispatch once
per key, the gate on the installed launcher's shape and its fallback, the launched-kernel
records, forget_launches, the per-thread scratch allocator; the op's eager repeats
(attention/fused.py, `_repeats`); on the GPU, repeated and kept launches of the real kernels.
"""

import collections
import warnings

import pytest
import torch

from attnscope import fused_attention
from attnscope.attention import fused
from attnscope.attention.reference import attention_reference
from attnscope.kernels import attention_fwd, launch
# nan_outputs: autouse, poisons every buffer the op allocates
from fused_checks import CPU, check, keep_launches, make_qkv, nan_outputs  # noqa: F401


@pytest.fixture(autouse=True)
def fresh_launches():
    """Each test starts in a process that has kept no launch, and leaves none of its own."""
    launch.forget_launches()
    yield
    launch.forget_launches()


@pytest.fixture
def direct_launcher_fits(monkeypatch):
    """Stand-in kernels launch as on a Triton whose launcher the direct call fits."""
    monkeypatch.setattr(launch, "direct_launch_ok", lambda: True)


def _jit_launch(kernel, bound=None):
    # A FastLaunch of a stand-in, taken for a JIT kernel (launch.FastLaunch checks the type).
    fast = launch.FastLaunch(kernel, bound)
    fast.jit = True
    return fast


class _RecordingKernel:
    """Stands in for a JIT kernel: kernel[grid](...) records the launch and returns a
    'compiled kernel' whose [grid](...) records the direct launches."""
    arg_names = ["X", "n", "BLOCK", "FLAG"]

    def __init__(self):
        self.jit_calls, self.direct_calls = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled
        return launch

    @property
    def compiled(self):
        kernel = self

        class Compiled:
            def __getitem__(self, grid):
                return lambda *args: kernel.direct_calls.append((grid, args))
        return Compiled()


def test_fast_launch_dispatches_once_per_key(direct_launcher_fits):
    kernel = _RecordingKernel()
    launch = _jit_launch(kernel)
    kwargs = dict(BLOCK=64, FLAG=True, num_warps=4)
    launch(("a",), (7,), ("x", 3), kwargs)
    launch(("a",), (7,), ("y", 3), kwargs)
    launch(("b",), (9, 2), ("z", 5), kwargs)
    assert [c[0] for c in kernel.jit_calls] == [(7,), (9, 2)]  # one JIT launch per key
    # the repeat passes every parameter in order (constexprs too) and a 3-D grid; a stand-in
    # for a compiled kernel takes that path rather than a C launcher it does not have
    assert kernel.direct_calls == [((7, 1, 1), ("y", 3, 64, True))]


def test_fast_launch_keeps_the_arguments_after_per_call(direct_launcher_fits):
    # Arguments from `per_call` on are fixed by the key: a repeat passes the first ones and the
    # launch appends those of the first call (what attention_fwd's lookup relies on).
    kernel = _RecordingKernel()
    shared = {}
    launch = _jit_launch(kernel, shared)
    kwargs = dict(BLOCK=64, FLAG=False)
    launch(("a",), (7,), ("x", 3), kwargs, per_call=1)
    assert list(shared) == [("a",)]  # kept in the dict it was given
    shared[("a",)](("y",))
    launch(("a",), (7,), ("z", 99), kwargs, per_call=1)
    assert kernel.direct_calls == [((7, 1, 1), ("y", 3, 64, False)),
                                   ((7, 1, 1), ("z", 3, 64, False))]


class _NoLaunchKernel(_RecordingKernel):
    """kernel[grid](...) returns None, as Triton's JIT does when a cache hook skips a launch."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.jit_calls.append(grid)


def test_fast_launch_does_not_keep_a_launch_that_did_not_happen(direct_launcher_fits):
    kernel = _NoLaunchKernel()
    launch = _jit_launch(kernel)
    for _ in range(2):
        assert launch(("a",), (7,), ("x", 3), dict(BLOCK=64, FLAG=True)) is None
    assert kernel.jit_calls == [(7,), (7,)] and launch.bound == {}  # each went through Triton


def test_fast_launch_is_off_in_the_interpreter():
    from attnscope.kernels import attention_fwd
    assert not attention_fwd._launch.enabled
    q, k, v = make_qkv(1, 2, 2, 40, 40, 32, torch.float16, CPU)
    check(q, k, v, 1e-3, 1e-3)
    check(q, k, v, 1e-3, 1e-3)
    assert attention_fwd._launch.bound == {} and launch.FORWARD_LAUNCHES == {}
    assert launch.launched() == []  # the interpreter compiles nothing


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128])  # the Triton kernel, and the Gluon one on sm_90
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_repeated_launches_are_right(head_dim, layout):
    # A repeat launch skips Triton's dispatch: fresh data, a new shape and an input at an odd
    # address (another specialization) must all still come out right. bshd: the op's repeats
    # hand the caller's tensors to the kept launch, not [batch, heads, seq, head_dim] views.
    for q_len in (384, 384, 512):
        q, k, v = make_qkv(2, 4, 2, q_len, q_len, head_dim, torch.bfloat16, "cuda", layout)
        check(q, k, v, 4e-3, 1e-3, layout=layout)
    if layout == "bshd":
        return
    # the call before, again, but q 2 bytes past a 16-byte boundary: only the alignment differs
    base = torch.randn(q.numel() + 1, dtype=q.dtype, device="cuda")
    check(base[1:].view(q.shape), k, v, 4e-3, 1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_an_inference_call_without_the_lse_gives_the_same_output(head_dim):
    # A call that returns no LSE launches its kernel without one (the Triton kernel at head_dim
    # 64 and 384 queries; on sm_90 the Gluon one at 128, at 256 (the output staged in Q's
    # buffer) and on three consumers at 64 and 4096 queries): the output of the call that returns
    # the LSE, bit for bit, on the first call and on the repeat.
    shapes = [(2, 4, 2, 384)] + ([(2, 16, 16, 4096)] if head_dim == 64 else [])
    for batch, heads, kv_heads, seq in shapes:
        q, k, v = make_qkv(batch, heads, kv_heads, seq, seq, head_dim, torch.bfloat16, "cuda")
        outs = [fused_attention(q, k, v) for _ in range(2)]
        expected, _ = check(q, k, v, 4e-3, 1e-3)
        assert all(torch.equal(out, expected) for out in outs)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])  # Triton; Gluon on sm_90 (Triton with TMA
#                                                       at 256 elsewhere)
def test_gpu_kept_launches_follow_the_call(head_dim):
    # A kept launch fixes every argument but the five tensors: another scale or alignment is
    # another key; a repeat from a new thread (its own scratch allocator, for the kernels that
    # make TMA descriptors on the device) or on a side stream launches there; and nothing the
    # caller passed is kept alive.
    import gc
    import threading
    import weakref
    q, k, v = make_qkv(2, 4, 2, 384, 512, head_dim, torch.bfloat16, "cuda")
    for scale in (None, 0.05, None):
        for alignment in ("top_left", "bottom_right"):
            check(q, k, v, 4e-3, 1e-3, scale=scale, causal_alignment=alignment)
    expected = fused_attention(q, k, v)
    outs = []
    thread = threading.Thread(target=lambda out, *qkv: out.append(fused_attention(*qkv)),
                              args=(outs, q, k, v))
    thread.start()
    thread.join()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs.append(fused_attention(q, k, v))
    torch.cuda.synchronize()
    assert len(outs) == 2 and all(torch.equal(out, expected) for out in outs)
    refs = [weakref.ref(t) for t in (q, k, v, expected)]
    del q, k, v, expected, outs
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.cuda
def test_gpu_kept_launches_are_direct_and_hooks_still_fire():
    # Where the launcher fits (Triton 3.6), a repeat calls the generated launcher itself (the host-time saving); with a
    # launch hook set (a profiler) it goes through Triton's runner, which calls the hook.
    import triton
    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16, "cuda")
    expected = fused_attention(q, k, v)
    if launch.direct_launch_ok():
        bound = launch.FORWARD_LAUNCHES
        assert bound and all(b.direct for b in bound.values())
    seen = []
    hooks = triton.knobs.runtime.launch_enter_hook
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    hooks.add(hook)
    try:
        out = fused_attention(q, k, v)
    finally:
        hooks.remove(hook)
    assert seen == ["_attn_fwd"] and torch.equal(out, expected)


def test_scratch_allocator_is_set_per_thread():
    # Triton keeps its allocator per thread: a launch from another thread (autograd's device
    # thread under activation checkpointing, a thread pool) must get one too.
    import threading
    seen = []

    def launch_side():
        launch.ensure_scratch_allocator()
        seen.append(launch._thread_allocator.get() is not launch._NULL_ALLOCATOR)
    thread = threading.Thread(target=launch_side)
    thread.start()
    thread.join()
    assert seen == [True]


def test_without_the_direct_launcher_every_call_is_triton_s_with_one_warning(monkeypatch):
    monkeypatch.setattr(launch, "direct_launch_ok", lambda: False)
    monkeypatch.setattr(launch, "_warned", False)
    kernel = _RecordingKernel()
    fast = _jit_launch(kernel)
    kwargs = dict(BLOCK=64, FLAG=True)
    with pytest.warns(RuntimeWarning, match="host time per call"):
        fast(("a",), (7,), ("x", 3), kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        fast(("a",), (7,), ("y", 3), kwargs)
    assert len(kernel.jit_calls) == 2 and kernel.direct_calls == [] and fast.bound == {}
    assert not fast.enabled


class _Launcher36:
    """The shape of Triton 3.6's CudaLauncher call, which the direct launcher reproduces."""

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, global_scratch, profile_scratch, *args)


class _LauncherPacked:
    """The shape of Triton 3.7's CudaLauncher call: the launch metadata and hooks by name, the
    kernel's arguments passed on as one tuple."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, kernel_metadata, launch_metadata, launch_enter_hook,
                    launch_exit_hook, global_scratch, profile_scratch, self.arg_annotations,
                    self.kernel_signature, args)


class _LauncherPackedNoScratch:
    """The packed signature, but a launcher call without the scratch buffers (a layout the
    direct launcher does not know)."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, kernel_metadata, launch_metadata, launch_enter_hook,
                    launch_exit_hook, args)


class _LauncherReordered:
    """The 3.6 signature, but the scratch buffers passed in another place."""

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, global_scratch, profile_scratch,
                    self.launch_cooperative_grid, self.launch_pdl, *args)


def test_the_gate_reads_the_launcher_s_call():
    assert launch.launcher_layout(_Launcher36) == "flat"
    assert launch.launcher_layout(_LauncherPacked) == "packed"
    assert launch.launcher_layout(_LauncherPackedNoScratch) is None
    assert launch.launcher_layout(_LauncherReordered) is None
    assert launch.launcher_layout(object) is None  # a builtin call: nothing to read


def test_the_installed_triton_gets_the_direct_launcher_only_where_it_fits():
    import triton
    from triton.backends.nvidia.driver import CudaLauncher
    layout = launch.launcher_layout(CudaLauncher)
    if triton.__version__.startswith("3.6."):
        assert layout == "flat"  # the launcher generated per signature
    elif triton.__version__.startswith(("3.7.", "3.8.", "3.9.")):
        assert layout == "packed"  # one generic launcher, the arguments as one tuple


def test_forget_launches_drops_every_kept_launch_and_record(direct_launcher_fits):
    kernel = _RecordingKernel()
    first, second = _jit_launch(kernel), _jit_launch(kernel, {})
    first(("a",), (7,), ("x", 3), dict(BLOCK=64, FLAG=True))
    second(("b",), (7,), ("x", 3), dict(BLOCK=64, FLAG=True))
    assert first.bound and second.bound and launch.launched()
    launch.forget_launches()
    assert first.bound == {} and second.bound == {} and launch.launched() == []


def test_launched_lists_the_most_recently_used_kernel_first(direct_launcher_fits):
    a, b = _RecordingKernel(), _RecordingKernel()
    fast_a, fast_b = _jit_launch(a), _jit_launch(b)
    fast_a.name, fast_b.name = "a", "b"
    kwargs = dict(BLOCK=64, FLAG=True)
    fast_a(("k",), (7,), ("x", 3), kwargs, config={"BLOCK": 64})
    fast_b(("k",), (7,), ("x", 3), kwargs)
    assert [name for name, _, _ in launch.launched()] == ["b", "a"]
    fast_a(("k",), (7,), ("y", 3), kwargs)  # a kept launch: a is the latest now
    assert [(name, config) for name, _, config in launch.launched()] == [
        ("a", {"BLOCK": 64}), ("b", None)]


# ---- the op's eager inference repeats -------------------------------------------------------

@pytest.fixture
def kept_forward(monkeypatch):
    """The Triton forward's launches are kept in the interpreter as on the GPU; returns a
    Counter of them by ("fwd", "triton" | "kept")."""
    counts = collections.Counter()
    keep_launches(monkeypatch, attention_fwd._launch, "fwd", counts)
    return counts


@pytest.fixture
def validations(monkeypatch):
    """Every call of the op's input checks, recorded (they still run)."""
    calls = []
    checks = fused._validate

    def recording(*args):
        calls.append(args)
        return checks(*args)
    monkeypatch.setattr(fused, "_validate", recording)
    return calls


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_an_inference_repeat_runs_the_kept_launch_without_the_checks(kept_forward, validations,
                                                                      layout):
    # The second call of one signature skips validation and dispatch: fresh NaN-poisoned
    # outputs, the first call's kernel launched directly, the same output and LSE bit for bit.
    q, k, v = make_qkv(2, 4, 2, 40, 56, 16, torch.float16, CPU, layout)
    first = check(q, k, v, 1e-3, 1e-3, layout=layout, causal_alignment="bottom_right")
    again = check(q, k, v, 1e-3, 1e-3, layout=layout, causal_alignment="bottom_right")
    assert len(validations) == 1 and kept_forward == {("fwd", "triton"): 1, ("fwd", "kept"): 1}
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert again[0].data_ptr() != first[0].data_ptr()  # a new output, not the old one again


def test_what_the_repeat_key_holds_is_a_new_call(kept_forward, validations):
    # Another scale, alignment, causal flag, dtype, key length, q or k address off a 16-byte
    # boundary, k's strides, a window or softcap, the same memory read as bshd, or inputs that
    # are a tensor subclass: each is validated and dispatched anew, and right.
    q, k, v = make_qkv(1, 2, 2, 33, 40, 16, torch.float16, CPU)

    def shifted(t):
        return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)
    strided_k = torch.empty(1, 2, 40, 32, dtype=k.dtype)[..., :16].copy_(k)
    as_bshd = tuple(t.transpose(1, 2) for t in (q, k, v))  # [1, 2, 33|40, 16] read as bshd
    calls = [((q, k, v), {}), ((q, k, v), dict(scale=0.3)),
             ((q, k, v), dict(causal_alignment="bottom_right")), ((q, k, v), dict(causal=False)),
             ((q.float(), k.float(), v.float()), {}), ((q, k[:, :, :36], v[:, :, :36]), {}),
             ((shifted(q), k, v), {}), ((q, shifted(k), v), {}), ((q, strided_k, v), {}),
             ((q, k, v), dict(window=(4, 0))), ((q, k, v), dict(softcap=5.0)),
             (as_bshd, dict(layout="bshd")),
             (tuple(torch.nn.Parameter(t, requires_grad=False) for t in (q, k, v)), {}),
             ((q, k, v), dict(scale=0.3))]  # the last: a repeat of the second
    for (qq, kk, vv), kwargs in calls:
        check(qq, kk, vv, 1e-5 if qq.dtype == torch.float32 else 1e-3, 1e-3, **kwargs)
    # kept twice: the repeat, and the subclass call (checked, then the dispatch's kept launch
    # of the first call: the same tensors underneath)
    assert len(validations) == len(calls) - 1 and kept_forward["fwd", "kept"] == 2


def test_a_repeat_still_refuses_what_the_checks_refuse(kept_forward):
    # A bool causal, a bool scale, a non-finite scale, a bad deterministic flag: the key never
    # matches them (or they fail its type rules), so the checks run and raise.
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, torch.float16, CPU)
    fused_attention(q, k, v, scale=1.0)
    fused_attention(q, k, v, causal=True)
    for kwargs, error in ((dict(causal=1), TypeError), (dict(scale=True), TypeError),
                          (dict(scale=float("inf")), TypeError),
                          (dict(deterministic="yes"), TypeError),
                          (dict(layout="bsdh"), ValueError)):
        with pytest.raises(error):
            fused_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("case", [
    dict(),
    dict(layout="bshd", causal_alignment="bottom_right", scale=1, q_len=17, kv_len=30,
         needs=(False, True, False)),  # only k needs grad; an int scale
    dict(causal_alignment="bottom_right", q_len=30, kv_len=17, deterministic=False,
         needs=(True, False, True)),
])
def test_training_calls_are_remembered_and_forget_launches_forgets(kept_forward, validations,
                                                                   case):
    # A call that needs gradients is remembered too, under a key of its own (its inputs require
    # grad): its repeat skips the checks and runs the kept launch under autograd's Function,
    # with the first call's arguments saved for the backward (types included) and its
    # gradients, bit for bit; forget_launches drops the remembered calls.
    case = dict(case)
    q_len, kv_len = case.pop("q_len", 24), case.pop("kv_len", 24)
    needs = case.pop("needs", (True, True, True))
    layout = case.get("layout", "bhsd")
    q, k, v = make_qkv(1, 2, 2, q_len, kv_len, 16, torch.float32, CPU, layout)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), needs)]
        out = fused_attention(*leaves, **case)
        grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dout)
        runs.append((out, out.grad_fn.attention_args, grads))
    assert len(validations) == 1
    (out0, args0, grads0), (out1, args1, grads1) = runs
    assert torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert args0 == args1 and [type(a) for a in args0] == [type(a) for a in args1]
    reference_kwargs = {k: v for k, v in case.items() if k != "deterministic"}
    check(q, k, v, 1e-5, 1e-5, **reference_kwargs)  # the output itself, against float64
    assert kept_forward["fwd", "triton"] == 1
    launch.forget_launches()
    fused_attention(q, k, v, **case)
    assert len(validations) == 3 and kept_forward["fwd", "triton"] == 2


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_an_inference_call_without_the_lse_allocates_and_stores_none(kept_forward, validations,
                                                                     monkeypatch, layout):
    # fused_attention(q, k, v) returns no LSE: one allocation (the output; the kernel gets it in
    # the LSE's place and stores no LSE), its own key (a call returning the LSE is validated and
    # dispatched anew), and the output of the call that returns one, bit for bit, on its first
    # call and on its repeat.
    shapes = []
    poisoned = fused._empty  # nan_outputs' NaN fill

    def recording(like, shape, dtype):
        shapes.append(tuple(shape))
        return poisoned(like, shape, dtype)
    monkeypatch.setattr(fused, "_empty", recording)
    q, k, v = make_qkv(2, 4, 2, 33, 40, 16, torch.float16, CPU, layout)
    outs = [fused_attention(q, k, v, layout=layout) for _ in range(2)]
    assert shapes == [tuple(q.shape)] * 2
    with_lse, lse = check(q, k, v, 1e-3, 1e-3, layout=layout)
    assert all(torch.equal(out, with_lse) for out in outs)
    assert len(validations) == 2 and kept_forward == {("fwd", "triton"): 2, ("fwd", "kept"): 1}
    again, lse_again = fused_attention(q, k, v, layout=layout, return_lse=True)
    assert torch.equal(again, with_lse) and torch.equal(lse_again, lse)
    assert len(validations) == 2 and kept_forward["fwd", "kept"] == 2


def test_inputs_that_require_grad_keep_their_lse_under_no_grad(kept_forward, validations):
    # An inference call of inputs that require grad (under no_grad) stores the LSE all the
    # same: its key is the one a training call repeats, whose backward reads the LSE.
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, torch.float32, CPU)
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        fused_attention(qg, k, v)
    out = fused_attention(qg, k, v)  # the remembered call, under autograd's Function
    assert len(validations) == 1 and kept_forward["fwd", "kept"] == 1
    dout = torch.randn_like(q)
    (grad,) = torch.autograd.grad(out, qg, dout)
    q64 = q.double().requires_grad_()
    ref = attention_reference(q64, k.double(), v.double())
    (ref_grad,) = torch.autograd.grad(ref, q64, dout.double())
    assert (grad.double() - ref_grad).abs().max().item() < 1e-4


def test_inputs_that_require_grad_under_no_grad_have_their_own_key(kept_forward, validations):
    # Under no_grad such inputs take _forward's prefill path (it keeps them off the decode
    # route): remembered under a key that says so, not the plain inputs' key.
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, torch.float32, CPU)
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        for _ in range(2):
            fused_attention(qg, k, v)
    assert len(validations) == 1
    fused_attention(q, k, v)
    fused_attention(q, k, v)
    assert len(validations) == 2
