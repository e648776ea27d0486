"""Tensor Core evidence: name table, SASS/PTX counting, ncu CSV parsing and the counter rule.

The SASS and PTX lines below were cut from real output: kernels compiled by triton 3.9 for
sm_90a/sm_80 and disassembled with the cuobjdump Triton ships. tests/data/ncu_sample.csv is a
stand-in with the layout of `ncu --csv --page raw --print-units base` until an H200 recording
replaces it; its softmax row has every hmma-pipe instruction typed HFMA2.MMA, as measured.
"""

import json
from pathlib import Path

import pytest
import torch

from attnscope.profile import tensor_cores as tc

DATA = Path(__file__).parent / "data"

FLASH = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
         "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t>>,"
         " false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)")
SOFTMAX = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float, "
           "c10::BFloat16, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>"
           "(c10::BFloat16*, const c10::BFloat16*, int)")


@pytest.mark.parametrize("name, verdict, family", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "yes", "nvjet"),
    ("nvjet_sss_tf32_128x256_TNT", "yes", "nvjet"),
    # FP32 nvjet without tf32: the name cannot say FFMA or emulation
    ("nvjet_sm90_sss_128x64_64x8_1x2_h_bz_NNN", "unknown", "nvjet_fp32"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_"
     "kernel0_0",
     "yes", "wgmma"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
     "yes", "cudnn_sdpa"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
     "segment_k_off_kernel__5x_cublas", "yes", "wgmma"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_"
     "alignc4_execute_kernel__5x_cublas", "no", "cublas_ffma_gemm"),
    ("sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x32_stage4_warpsize2x2x1_"
     "tensor16x8x16"
     "_kernel", "yes", "xmma_low_precision"),
    ("ampere_sgemm_128x64_nn", "no", "cublas_sgemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "yes", "mma_shape"),
    ("volta_h884gemm_64x64_ldg8_nn", "yes", "mma_shape"),
    (FLASH, "yes", "flash_attn"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>>"
     "(flash::Flash_fwd_params)",
     "yes", "flash_attn"),
    ("void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<64, 64, 128, 4>, 4, 6>"
     "(flash::Flash_fwd_params)", "no", "flash_combine"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::"
     "bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "yes",
     "mem_efficient_sm80"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm50(PyTorchMemEffAttention::AttentionKernel<float, "
     "cutlass::arch::Sm50, true, 64, 64, 64, true, true>::Params)", "no", "mem_efficient_sm50"),
    ("cutlass3x_sm90_tensorop_s64x128x16gemm_bf16_bf16_f32_bf16_bf16_128x128x64_1x1x1_0_tnn_align8",
     "yes", "cutlass_tensorop"),
    (SOFTMAX, "no", "softmax"),
    ("void at::native::(anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, "
     "float, 10, false, false>(c10::BFloat16*, const c10::BFloat16*, int, int, int, bool const*, "
     "int, bool)", "no", "softmax"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
     "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)", "no",
     "elementwise"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::"
     "TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}>", "no",
     "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "no", "reduce_scan"),
    ("void at::native::triu_tril_kernel<bool, int, false, 4, true>", "no", "fill_copy_index"),
    ("Memcpy DtoD (Device -> Device)", "no", "memcpy_memset"),
    ("triton_poi_fused__softmax_0", "no", "inductor_pointwise_reduction"),
    ("triton_tem_fused_0", "unknown", "triton"),
    ("_attn_fwd", "unknown", None),           # ours: only tier 2 or 1 can tell
    ("my_custom_kernel", "unknown", None),   # never a guess
])
def test_name_verdict(name, verdict, family):
    got = tc.name_verdict(name)
    assert (got["verdict"], got["evidence"], got["family"]) == (verdict, "name", family)
    assert got["reason"]


def test_every_family_is_documented():
    for family in tc.NAME_FAMILIES:
        assert family.verdict in ("yes", "no", "unknown") and len(family.reason) > 20, family


SASS_HOPPER = """
\tcode for sm_90a
\t\tFunction : dot_kernel
   /*0a90*/   WARPGROUP.ARRIVE ;   /* 0x0000000000007... */
   /*0aa0*/   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4].tnspB, RZ, !UPT ;   /* 0x40e00000041879f0 */
   /* 0x000fe20008700818 */
   /*0af0*/   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4].tnspB, R24 ;   /* 0x40e00000041879f0 */
   /*0b90*/   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4].tnspB, R24, gsb0 ;  /* 0x40e00000041879f0 */
   /*0ba0*/   HFMA2.MMA R3, -RZ, RZ, 0, 0 ;   /* 0x000000ffff037435 */
   /*0bb0*/   @!P0 FFMA R5, R2, R5, R3 ;   /* 0x0000000502058223 */
"""
SASS_AMPERE = """
   /*0a90*/   HMMA.16816.F32.BF16 R32, R68.reuse, R52, RZ ;   /* 0x000000344420723c */
   /*0aa0*/   HMMA.16816.F32.BF16 R40, R68, R24.reuse, RZ ;   /* 0x000000184428723c */
   /*0ab0*/   LDSM.16.M88.4 R4, [R2] ;   /* 0x000000000204783b */
"""
SASS_FP32_DOT = """
   /*0320*/   FFMA R28, R16.reuse, R22.reuse, RZ ;   /* 0x00000016101c7223 */
   /*0330*/   FFMA R16, R16, R23.reuse, RZ ;   /* 0x0000001710107223 */
   /*0340*/   LDS.64 R22, [R3+0x100] ;   /* 0x0001000003167984 */
"""
SASS_SOFTMAX = """
   /*03d0*/   FMUL R5, R5, 1.4426950216293334961 ;   /* 0x3fb8aa3b05057820 */
   /*03e0*/   MUFU.EX2 R5, R5 ;   /* 0x0000000500057308 */
   /*03f0*/   HFMA2.MMA R7, -RZ, RZ, 1.875, 0 ;   /* 0x3f80000000077435 */
   /*0400*/   HFMA2 R8, R6.H0_H0, R9, -RZ ;   /* 0x0000000906087231 */
"""


def test_sass_hopper_dot_is_yes_and_counts_opcodes():
    got = tc.sass_verdict(SASS_HOPPER)
    assert (got["verdict"], got["evidence"]) == ("yes", "sass")
    c = got["counts"]
    assert (c["HGMMA"], c["HFMA2.MMA"], c["FFMA"], c["HFMA2"], c["instructions"]) == (3, 1, 1, 0, 6)


def test_sass_ampere_dot_is_yes():
    got = tc.sass_verdict(SASS_AMPERE)
    assert got["verdict"] == "yes" and got["counts"]["HMMA"] == 2


def test_sass_fp32_dot_and_softmax_are_no():
    fp32 = tc.sass_verdict(SASS_FP32_DOT)
    assert fp32["verdict"] == "no" and fp32["counts"]["FFMA"] == 2
    soft = tc.sass_verdict(SASS_SOFTMAX)
    # HFMA2.MMA runs on the tensor pipe but is no matrix instruction
    assert soft["verdict"] == "no"
    c = soft["counts"]
    assert (c["HFMA2.MMA"], c["HFMA2"], c["MUFU.EX2"]) == (1, 1, 1)


def test_sass_without_instructions_is_unknown():
    assert tc.sass_verdict("cuobjdump info    : File 'x.cubin' does not contain device code")[
        "verdict"] == "unknown"


PTX_HOPPER = """
.visible .entry dot_kernel(
\t.param .u64 .ptr .global .align 1 dot_kernel_param_0
)
{
\t.reg .b32 \t%r<300>;
\twgmma.fence.sync.aligned;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1,%r2,%r3,%r4},
		%rd65, %rd66, 0, 1, 1, 0, 1;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1,%r2,%r3,%r4},
		%rd67, %rd68, %p1, 1, 1, 0, 1;
\twgmma.commit_group.sync.aligned;
\twgmma.wait_group.sync.aligned 0;
\tret;
}
"""
PTX_AMPERE = ("\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %r17, %r18, %r19, %r20 }, "
              "{ %r1, %r2, %r3, %r4 }, { %r5, %r6 }, { %r17, %r18, %r19, %r20 };\n\tret;\n")
PTX_FP32 = ("\tfma.rn.f32 \t%r234, %r39, %r170, 0f00000000;\n"
            "\tfma.rn.f32 \t%r235, %r40, %r172, %r234;\n\tex2.approx.f32 \t%r65, %r64;\n")


def test_ptx_counts():
    hopper = tc.ptx_verdict(PTX_HOPPER)
    # fence/commit/wait are not matrix instructions; only the two mma_async are
    assert (hopper["verdict"], hopper["evidence"], hopper["counts"]["wgmma.mma_async"]) == (
        "yes", "ptx", 2)
    assert tc.ptx_verdict(PTX_AMPERE)["counts"]["mma.sync"] == 1
    fp32 = tc.ptx_verdict(PTX_FP32)
    assert (fp32["verdict"], fp32["counts"]["fma.f32"], fp32["counts"]["ex2"]) == ("no", 2, 1)


class _FakeCompiled:
    """The parts of triton's CompiledKernel that tier 2 reads."""

    def __init__(self, name, ptx):
        self.name, self.asm = name, {"ptx": ptx}


def test_triton_kernel_verdict_falls_back_to_ptx_without_cubin():
    got = tc.triton_kernel_verdict(_FakeCompiled("_attn_fwd", PTX_HOPPER))
    assert (got["verdict"], got["evidence"]) == ("yes", "ptx")


def test_jit_cache_walk_reads_triton3_layout_and_skips_futures():
    class Jit:  # device_caches[device] = (kernel_cache, key_cache, target, backend, binder)
        device_caches = {0: ({"k1": _FakeCompiled("_attn_fwd", PTX_HOPPER), "k2": object()},
                             {}, None, None, None)}

    class Autotuner:
        fn = Jit()

    got = tc.triton_verdicts(["_attn_fwd", "other"], jit_functions=[Autotuner()])
    assert list(got) == ["_attn_fwd"]
    assert (got["_attn_fwd"]["verdict"], got["_attn_fwd"]["variants"]) == ("yes", 1)


def test_parse_ncu_csv_raw_page():
    launches = tc.parse_ncu_csv((DATA / "ncu_sample.csv").read_text())
    assert [r["id"] for r in launches] == [0, 1, 2, 3]
    assert launches[1]["kernel"] == SOFTMAX
    m = launches[2]["metrics"]
    assert m[tc.FFMA_THREADS] == 8_589_934_592  # "8,589,934,592": thousands separators
    assert m[tc.TENSOR_PIPE_PCT] == pytest.approx(0.12)


def test_parse_ncu_csv_details_page_and_scaled_units():
    text = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Section Name","Metric Name","Metric Unit","Metric Value"\n'
            'some program output\n'
            '"0","1","python","h","k(float*)","1","7","Command line profiler metrics",'
            f'"{tc.HMMA}","Minst","1.50"\n'
            '"0","1","python","h","k(float*)","1","7","Command line profiler metrics",'
            f'"{tc.GMMA}","inst","n/a"\n')
    (launch,) = tc.parse_ncu_csv(text)
    assert launch["metrics"] == {tc.HMMA: 1_500_000, tc.GMMA: None}


def test_parse_ncu_csv_rejects_text_without_table():
    with pytest.raises(ValueError, match="no ncu CSV table"):
        tc.parse_ncu_csv("==ERROR== ERR_NVGPUCTRPERM - no permission\n")


def test_counter_rule_on_sample():
    got = tc.counter_verdicts(tc.parse_ncu_csv((DATA / "ncu_sample.csv").read_text()))
    by_family = {tc.name_verdict(name)["family"]: v for name, v in got.items()}
    # softmax: 3.1M hmma-pipe instructions and 2.4 % tensor-pipe activity, all HFMA2.MMA
    assert by_family["softmax"]["verdict"] == "no"
    assert by_family["softmax"]["metrics"][tc.HMMA] > 1e6
    assert by_family["softmax"]["metrics"]["matrix_instructions"] == 0
    assert by_family["nvjet"]["verdict"] == "yes"       # wgmma
    assert by_family["cublas_ffma_gemm"]["verdict"] == "no"  # FP32 FFMA GEMM
    assert by_family["flash_attn"]["verdict"] == "yes"  # HMMA beyond its HFMA2.MMA
    assert by_family["flash_attn"]["metrics"]["matrix_instructions"] == 4_325_376 - 131_072
    assert all(v["evidence"] == "counters" and v["rule"] == tc.COUNTER_RULE for v in got.values())


def test_counter_rule_counts_gmma_once_and_needs_its_inputs():
    base = {tc.GMMA: 100, tc.HMMA: 130, tc.HFMA2_MMA: 30, tc.IMMA: 0, tc.DMMA: 0}
    assert tc.matrix_instructions(base) == 100  # gmma folded into hmma: not counted twice
    assert tc.matrix_instructions({**base, tc.HMMA: 30}) == 100  # or not folded in
    missing = tc.counter_verdict({tc.HMMA: 5})
    assert missing["verdict"] == "unknown" and tc.HFMA2_MMA in missing["reason"]


def test_combine_prefers_the_strongest_definite_tier():
    name = tc.name_verdict("_attn_fwd")
    sass = {"verdict": "yes", "evidence": "sass", "counts": {"HGMMA": 4}}
    counters = {"verdict": "no", "evidence": "counters", "metrics": {}, "rule": ""}
    unknown_counters = {"verdict": "unknown", "evidence": "counters", "metrics": {}, "rule": ""}
    assert tc.combine(name, sass, counters)["verdict"] == "no"
    assert tc.combine(name, sass, counters)["other"] == {"sass": "yes", "name": "unknown"}
    assert tc.combine(unknown_counters, name, sass)["evidence"] == "sass"
    assert tc.combine(name)["verdict"] == "unknown"
    assert tc.combine(None)["verdict"] == "unknown"


def test_forward_summary():
    gemm = {"name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"}
    soft = {"name": SOFTMAX}
    flash = {"name": FLASH, "tensor_cores": {"verdict": "yes", "evidence": "counters"}}
    assert tc.forward_summary([flash]) == {"verdict": "yes", "evidence": "counters"}
    assert tc.forward_summary([gemm, soft, gemm]) == {
        "verdict": "partial: nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "evidence": "name"}
    assert tc.forward_summary([soft])["verdict"] == "no"
    assert tc.forward_summary([soft, {"name": "_attn_fwd"}])["verdict"] == "unknown"
    assert tc.forward_summary([flash, soft])["evidence"] == "counters, name"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tier2_on_a_compiled_triton_dot():
    import triton
    import triton.language as tl

    @triton.jit
    def tiny_dot(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tile = offs[:, None] * BLOCK + offs[None, :]
        tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))

    a, b = (torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.full((64, 64), float("nan"), device="cuda")
    tiny_dot[(1,)](a, b, c, BLOCK=64)
    torch.testing.assert_close(c, a.float() @ b.float(), atol=1e-2, rtol=1e-2)
    got = tc.triton_verdicts(["tiny_dot"], jit_functions=[tiny_dot])["tiny_dot"]
    assert got["verdict"] == "yes"
    if got["evidence"] == "sass":
        assert got["counts"]["HGMMA"] + got["counts"]["HMMA"] > 0
    else:
        assert got["counts"]["wgmma.mma_async"] + got["counts"]["mma.sync"] > 0
    # the garbage-collector path finds the same kernel without being told where it lives
    assert tc.triton_verdicts(["tiny_dot"])["tiny_dot"]["verdict"] == "yes"


def test_ncu_merge_into_results(tmp_path):
    from attnscope.profile import ncu

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": [
        {"impl": "naive", "kernels": [{"name": SOFTMAX, "tensor_cores": tc.name_verdict(SOFTMAX)},
                                      {"name": "_attn_fwd"}]},
        {"impl": "flex", "kernels": [{"name": "triton_tem_fused_0"}]}]}))
    counters = tc.counter_verdicts(tc.parse_ncu_csv((DATA / "ncu_sample.csv").read_text()))
    # ncu may print the name without the return type: matched all the same
    counters = {name.removeprefix("void "): v for name, v in counters.items()}
    counters["_attn_fwd"] = {"verdict": "yes", "evidence": "counters", "metrics": {}, "rule": ""}
    ncu.merge_into_results(results, {"naive": counters})
    rows = json.loads(results.read_text())["rows"]
    soft, ours = rows[0]["kernels"]
    assert (soft["tensor_cores"]["evidence"], soft["tensor_cores"]["verdict"]) == ("counters", "no")
    assert soft["tensor_cores"]["other"] == {"name": "no"}
    assert rows[0]["tensor_cores"] == {"verdict": "partial: _attn_fwd", "evidence": "counters"}
    assert "tensor_cores" not in rows[1]  # no counters for flex: left as compare wrote it
