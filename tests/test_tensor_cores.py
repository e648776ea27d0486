"""Tensor Core evidence: name table, SASS/PTX counting, ncu CSV parsing and the counter rule.

The SASS and PTX lines below were cut from real output: kernels compiled by triton 3.9 for
sm_90a/sm_80 and disassembled with the cuobjdump Triton ships. The ncu CSVs are the real ones
under tests/data/h200_seed/ncu/: `python -m attnscope.profile ncu --impl naive sdpa_math
sdpa_flash sdpa_efficient sdpa_cudnn flex fused --out DIR` after `compare --out DIR` on an H200
(driver 580.159.04, torch 2.11.0+cu130, triton 3.6.0, cuDNN 9.19; ncu --page raw --print-units
base, one profiled forward per implementation). The synthetic tests/data/ncu_sample.csv is no
longer used: the real CSVs have thousands separators, a units row, NVTX columns, program output
around the table and kernels of every family it stood in for.
"""

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from attnscope.profile import compiled
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

    got = compiled.triton_verdicts(["_attn_fwd", "other"], jit_functions=[Autotuner()])
    assert list(got) == ["_attn_fwd"]
    assert (got["_attn_fwd"]["verdict"], got["_attn_fwd"]["variants"]) == ("yes", 1)


NCU = DATA / "h200_seed" / "ncu"
NCU_IMPLS = ("naive", "sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex", "fused")


def _launches(impl):
    return tc.parse_ncu_csv((NCU / f"{impl}.csv").read_text())


def _counters(impl):
    return tc.counter_verdicts(_launches(impl))


def test_the_scan_of_live_objects_warns_nothing():
    # compiled_triton_kernels looks at every object gc knows; torch's deprecated
    # `torch.distributed.reduce_op` warns when looked at, which the drivers would keep in a row.
    import warnings
    noisy = getattr(torch.distributed, "reduce_op", None)  # alive while the scan runs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled.compiled_triton_kernels()
    assert [str(w.message) for w in caught] == [], noisy


def test_parse_real_ncu_csvs():
    # one profiled forward per implementation: as many launches as the trace's kernels/forward
    counts = {impl: len(_launches(impl)) for impl in NCU_IMPLS}
    assert counts == {"naive": 5, "sdpa_math": 20, "sdpa_flash": 1, "sdpa_efficient": 1,
                      "sdpa_cudnn": 1, "flex": 1, "fused": 1}
    naive = _launches("naive")
    assert [r["id"] for r in naive] == [0, 1, 2, 3, 4]
    assert [tc.short_name(r["kernel"]) for r in naive] == [
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "at::vectorized_elementwise_kernel",
        "at::elementwise_kernel", naive[3]["kernel"],  # "void <unnamed>::softmax_warp_forward<"
        "nvjet_sm90_tst_64x512_64x2_1x2_h_bz_coopB_NNT"]
    m = naive[0]["metrics"]
    assert (m[tc.GMMA], m[tc.HMMA], m[tc.HFMA2_MMA]) == (262_144, 262_144, 0)  # "262,144"
    assert m[tc.TENSOR_PIPE_PCT] == pytest.approx(22.77)
    assert m[tc.DURATION] == 83_776  # ns
    gemm = _launches("sdpa_math")[10]["metrics"]
    assert gemm[tc.FFMA_THREADS] == 8_724_152_320  # "8,724,152,320"
    assert all(set(tc.COUNTER_METRICS) <= set(r["metrics"]) for impl in NCU_IMPLS
               for r in _launches(impl))


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


# Counter verdicts at the seed shape, per kernel: (substring of the ncu kernel name, verdict,
# matrix instructions = max(hmma - hfma2, gmma) + imma + dmma), read off the CSVs.
SEED_VERDICTS = {
    "naive": [
        ("nvjet_sm90_tst_256x128", "yes", 262_144),  # gmma = hmma = 262,144: HGMMA
        ("nvjet_sm90_tst_64x512", "yes", 131_072),  # gmma = hmma = 131,072
        ("MulFunctor", "no", 0),  # hmma 0
        ("masked_fill_kernel", "no", 0),  # hmma = hfma2 = 4,194,304; tensor pipe 2.35 %
        ("softmax_warp_forward", "no", 0),  # hmma = hfma2 = 2,289,664; tensor pipe 1.59 %
    ],
    "sdpa_math": [
        # the FP32 GEMMs: 8,724,152,320 and 8,598,323,200 FFMA thread-instructions, FMA pipe
        # 53.30 % / 64.28 % active; their 32,768 / 16,384 hmma-pipe instructions are all HFMA2.MMA
        ("sm80_xmma_gemm_f32f32_f32f32_f32_tn", "no", 0),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_nn", "no", 0),
        ("direct_copy_kernel_cuda", "no", 0), ("MulFunctor", "no", 0),
        ("FillFunctor<bool>", "no", 0), ("triu_tril_kernel", "no", 0),  # triu: 8,192 HFMA2.MMA
        ("FillFunctor<float>", "no", 0),
        ("where_kernel_impl", "no", 0),  # 32,768 and 6,291,456 HFMA2.MMA (two launches)
        ("CUDAFunctor_add", "no", 0),  # 4,194,304 HFMA2.MMA
        ("softmax_warp_forward<float", "no", 0),  # 2,289,664 HFMA2.MMA, tensor pipe 1.62 %
        ("isneginf_kernel_impl", "no", 0), ("and_kernel_cuda", "no", 0),  # and: 131,072
        ("bfloat16_copy_kernel_cuda", "no", 0),
    ],
    "sdpa_flash": [("flash_fwd_kernel", "yes", 4_718_592)],  # HMMA (mma.sync), gmma 0
    "sdpa_efficient": [("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "yes", 8_912_896)],  # HMMA
    "sdpa_cudnn": [("cudnn_generated_fort_native_sdpa_sm90", "yes", 442_368)],  # HGMMA
    "flex": [("triton_tem_fused_flex_attention_0", "yes", 442_368)],  # HGMMA
    "fused": [("_attn_fwd", "yes", 589_824)],  # HGMMA
}


@pytest.mark.parametrize("impl", NCU_IMPLS)
def test_counter_verdicts_at_the_seed_shape(impl):
    got = _counters(impl)
    expected = SEED_VERDICTS[impl]
    assert len(got) == len(expected)  # distinct kernel names
    for name, v in got.items():
        (row,) = [row for row in expected if row[0] in name]
        assert (v["verdict"], v["metrics"]["matrix_instructions"]) == row[1:], name
        assert v["evidence"] == "counters" and v["rule"] == tc.COUNTER_RULE


def test_counter_trap_on_real_kernels():
    """Kernels that do no matrix math yet show hmma-pipe instructions and tensor-pipe activity:
    every one of those instructions is HFMA2.MMA, so the rule reads exactly 0 for them."""
    trapped = {}
    for impl in NCU_IMPLS:
        for launch in _launches(impl):
            m = launch["metrics"]
            if m[tc.HMMA] > 0 and m[tc.GMMA] == 0 and m[tc.HMMA] == m[tc.HFMA2_MMA]:
                trapped[(impl, launch["id"])] = (m[tc.HMMA], m[tc.TENSOR_PIPE_PCT])
                assert tc.counter_verdict(m)["verdict"] == "no"
    # naive's softmax_warp_forward<bf16>: 2,289,664 hmma = 2,289,664 hfma2, tensor pipe 1.59 %
    assert trapped[("naive", 3)] == (2_289_664, pytest.approx(1.59))
    assert trapped[("naive", 2)] == (4_194_304, pytest.approx(2.35))  # masked_fill
    assert trapped[("sdpa_math", 12)] == (2_289_664, pytest.approx(1.62))  # softmax, fp32
    assert trapped[("sdpa_math", 16)] == (6_291_456, pytest.approx(3.07))  # where
    # 2 in naive; in SDPA math triu, where x2, both FFMA GEMMs, add, softmax, and-reduce
    assert sorted(trapped) == [("naive", 2), ("naive", 3), *(("sdpa_math", i) for i in
                                                              (5, 8, 10, 11, 12, 14, 16, 18))]
    # a rule of "hmma > 0" or "tensor pipe active" would call all ten Tensor Core kernels
    assert all(hmma > 0 and pct > 0 for hmma, pct in trapped.values())
    # and no kernel with real matrix math executed a single HFMA2.MMA at this shape
    for impl in NCU_IMPLS:
        for launch in _launches(impl):
            m = launch["metrics"]
            if tc.matrix_instructions(m) > 0:
                assert m[tc.HFMA2_MMA] == 0, launch["kernel"]


def test_gmma_is_folded_into_hmma_on_this_ncu():
    # ncu 2025.3 on the H200 counts each HGMMA in hmma.sum too; max() counts it once
    for impl in ("sdpa_cudnn", "flex", "fused"):
        (launch,) = _launches(impl)
        m = launch["metrics"]
        assert m[tc.GMMA] == m[tc.HMMA] > 0 and tc.matrix_instructions(m) == m[tc.GMMA]


def test_name_tier_agrees_with_counters_on_real_kernels():
    for impl in NCU_IMPLS:
        for name, v in _counters(impl).items():
            by_name = tc.name_verdict(name)["verdict"]
            # Triton kernels (flex's template, ours) carry no math type in their names
            if name in ("triton_tem_fused_flex_attention_0", "_attn_fwd"):
                assert by_name == "unknown"
            else:
                assert by_name == v["verdict"], name


_VERDICT_LINE = re.compile(r"^\s+(yes|no|unknown)\s+matrix inst (\S+)\s+tensor pipe (\S+)%\s+"
                           r"(.+)$")


def test_recorded_ncu_verdicts_match_the_csvs():
    """ncu_verdicts.txt is what the ncu subcommand printed on the H200; the same CSVs, parsed
    here, give the same lines."""
    printed, impl = {}, None
    for line in (NCU / "ncu_verdicts.txt").read_text().splitlines():
        if m := re.match(r"^\[\d+/\d+\] (\w+): profiling", line):
            impl = m.group(1)
            printed[impl] = []
        elif m := _VERDICT_LINE.match(line):
            verdict, matrix, pct, name = m.groups()
            printed[impl].append((verdict, float(matrix), float(pct), name))
    assert list(printed) == list(NCU_IMPLS)
    for impl in NCU_IMPLS:
        computed = [(v["verdict"], v["metrics"]["matrix_instructions"],
                     pytest.approx(v["metrics"][tc.TENSOR_PIPE_PCT], abs=0.005),
                     tc.short_name(name)) for name, v in _counters(impl).items()]
        assert printed[impl] == computed, impl


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
    got = compiled.triton_verdicts(["tiny_dot"], jit_functions=[tiny_dot])["tiny_dot"]
    assert got["verdict"] == "yes"
    if got["evidence"] == "sass":
        assert got["counts"]["HGMMA"] + got["counts"]["HMMA"] > 0
    else:
        assert got["counts"]["wgmma.mma_async"] + got["counts"]["mma.sync"] > 0
    # the garbage-collector path finds the same kernel without being told where it lives
    assert compiled.triton_verdicts(["tiny_dot"])["tiny_dot"]["verdict"] == "yes"


def _compare_output(tmp_path):
    """results.json as `compare` left it, before `ncu` merged counters in: name verdicts only."""
    data = json.loads((DATA / "h200_seed" / "results.json").read_text())
    for row in data["rows"]:
        row.pop("tensor_cores", None)
        for kernel in row.get("kernels") or []:
            kernel["tensor_cores"] = tc.name_verdict(kernel["name"])
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    return path


def test_a_partial_forward_counts_its_kernels_that_cannot_tell():
    from attnscope.profile.table import _verdict_cell

    yes = {"verdict": "yes", "evidence": "sass"}
    unknown = {"verdict": "unknown", "evidence": "name", "reason": "no evidence"}
    summary = tc.forward_summary([{"name": "gemm", "tensor_cores": yes},
                                  {"name": "mystery", "tensor_cores": unknown}])
    assert summary == {"verdict": "partial: gemm", "evidence": "sass, name", "unknown": 1}
    assert _verdict_cell(summary) == "partial: gemm (sass, name; 1 kernel cannot tell)"
    no = {"verdict": "no", "evidence": "counters"}
    assert "unknown" not in tc.forward_summary([{"name": "gemm", "tensor_cores": yes},
                                                {"name": "copy", "tensor_cores": no}])


def test_a_name_of_several_launches_says_its_counters_are_a_mean():
    # SDPA math's where kernel: two launches of one name, 32,768 and 6,291,456 HMMA
    from attnscope.profile.table import evidence_text

    def metrics(hmma, pct):
        return {tc.GMMA: 0, tc.HMMA: hmma, tc.HFMA2_MMA: 0, tc.IMMA: 0, tc.DMMA: 0,
                tc.TENSOR_PIPE_PCT: pct}
    launches = [{"id": 0, "kernel": "where", "metrics": metrics(32768, 1.81)},
                {"id": 1, "kernel": "where", "metrics": metrics(6291456, 3.02)},
                {"id": 2, "kernel": "gemm", "metrics": metrics(4096, 50.0)}]
    verdicts = tc.counter_verdicts(launches)
    assert verdicts["where"]["launches"] == 2
    assert verdicts["where"]["matrix_instructions_range"] == [32768, 6291456]
    assert "(mean of 2 launches; 32,768 to 6,291,456 each)" in evidence_text(verdicts["where"])
    assert "mean of" not in evidence_text(verdicts["gemm"])
    assert "matrix_instructions_range" not in verdicts["gemm"]


def test_ncu_merge_into_real_results(tmp_path):
    from attnscope.profile import ncu

    path = _compare_output(tmp_path)
    ncu.merge_into_results(path, {impl: _counters(impl) for impl in NCU_IMPLS})
    rows = {row["impl"]: row for row in json.loads(path.read_text())["rows"]}
    # kernels whose Kineto and ncu names agree (no namespaces or template arguments to differ)
    for impl in ("sdpa_cudnn", "flex", "fused"):
        (kernel,) = rows[impl]["kernels"]
        assert (kernel["tensor_cores"]["verdict"], kernel["tensor_cores"]["evidence"]) == (
            "yes", "counters")
        assert rows[impl]["tensor_cores"] == {"verdict": "yes", "evidence": "counters"}
    gemms = [k for k in rows["sdpa_math"]["kernels"] if "sm80_xmma_gemm" in k["name"]]
    assert [(k["tensor_cores"]["verdict"], k["tensor_cores"]["evidence"]) for k in gemms] == [
        ("no", "counters")] * 2
    assert rows["sdpa_math"]["tensor_cores"]["verdict"] == "no"
    nvjet = [k for k in rows["naive"]["kernels"] if k["name"].startswith("nvjet")]
    assert [k["tensor_cores"]["evidence"] for k in nvjet] == ["counters"] * 2
    assert rows["naive"]["tensor_cores"]["verdict"] == (
        "partial: nvjet_sm90_tst_64x512_64x2_1x2_h_bz_coopB_NNT, "
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT")
    assert "tensor_cores" not in rows["naive_inplace"]  # not run under ncu: left as it was


def test_ncu_merge_gives_every_profiled_kernel_counter_evidence(tmp_path):
    from attnscope.profile import ncu

    path = _compare_output(tmp_path)
    ncu.merge_into_results(path, {impl: _counters(impl) for impl in NCU_IMPLS})
    rows = {row["impl"]: row for row in json.loads(path.read_text())["rows"]}
    for impl in NCU_IMPLS:
        evidence = {k["name"][:60]: k["tensor_cores"]["evidence"] for k in rows[impl]["kernels"]}
        assert set(evidence.values()) == {"counters"}, (impl, evidence)
        assert rows[impl]["tensor_cores"]["evidence"] == "counters", impl
    assert rows["sdpa_flash"]["tensor_cores"]["verdict"] == "yes"
    assert rows["sdpa_efficient"]["tensor_cores"]["verdict"] == "yes"
    assert rows["sdpa_math"]["tensor_cores"]["verdict"] == "no"
    # without the traces at hand (results.json moved), by name: every pairing is exact
    for impl in NCU_IMPLS:
        for k in rows[impl]["kernels"]:
            assert k["tensor_cores"]["matched_by"] == "name"
            assert ncu._name_key(k["tensor_cores"]["ncu_kernel"]) == ncu._name_key(k["name"])
    flash = rows["sdpa_flash"]["kernels"][0]["tensor_cores"]
    assert flash["ncu_kernel"].startswith("void flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128")
    assert flash["other"] == {"name": "yes"}


def test_a_second_ncu_merge_keeps_the_weaker_tiers(tmp_path):
    # ncu after ncu (or --stalls after ncu): the new counters replace the old ones, and the
    # name and SASS tiers the first merge kept stay under `other`
    from attnscope.profile import ncu

    path = _compare_output(tmp_path)
    counters = {impl: _counters(impl) for impl in NCU_IMPLS}
    ncu.merge_into_results(path, counters)
    first = json.loads(path.read_text())
    ncu.merge_into_results(path, counters)
    second = json.loads(path.read_text())
    for row_1, row_2 in zip(first["rows"], second["rows"]):
        assert row_1 == row_2, row_1["impl"]
    flash = {r["impl"]: r for r in second["rows"]}["sdpa_flash"]["kernels"][0]["tensor_cores"]
    assert flash["other"] == {"name": "yes"}
    # a second run whose counters cannot tell keeps the first run's
    unknown = {impl: {name: {"verdict": "unknown", "evidence": "counters", "reason": "missing"}
                      for name in verdicts} for impl, verdicts in counters.items()}
    ncu.merge_into_results(path, unknown)
    flash = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}["sdpa_flash"]
    verdict = flash["kernels"][0]["tensor_cores"]
    assert (verdict["verdict"], verdict["evidence"]) == ("yes", "counters")


def test_ncu_merge_by_launch_order(tmp_path):
    """With the traces beside results.json and ncu's launches, kernels pair by launch order:
    SDPA math's 20 launches of 13 kernels, whose 5 `vectorized_elementwise_kernel`s and 2
    `elementwise_kernel`s share base names, pair one to one."""
    import shutil

    from attnscope.profile import ncu

    path = _compare_output(tmp_path)
    for impl in NCU_IMPLS:
        trace = next((DATA / "h200_seed" / impl).glob("*.json.gz"))
        (tmp_path / impl).mkdir()
        shutil.copy(trace, tmp_path / impl / trace.name)
    ncu.merge_into_results(path, {impl: _counters(impl) for impl in NCU_IMPLS},
                           {impl: _launches(impl) for impl in NCU_IMPLS})
    rows = {row["impl"]: row for row in json.loads(path.read_text())["rows"]}
    for impl in NCU_IMPLS:
        for k in rows[impl]["kernels"]:
            v = k["tensor_cores"]
            assert (v["evidence"], v["matched_by"]) == ("counters", "launch order"), k["name"]
            assert ncu._name_key(v["ncu_kernel"]) == ncu._name_key(k["name"])
    assert rows["sdpa_math"]["tensor_cores"] == {"verdict": "no", "evidence": "counters"}
    # The traces beside it carry the merged verdicts: analyze says what the table says.
    from attnscope.profile.trace import analyze_file
    for impl in NCU_IMPLS:
        trace = next((tmp_path / impl).glob("*.json.gz"))
        analysed = analyze_file(trace)["ranges"][impl]["kernels"]
        assert {k["name"]: k["tensor_cores"] for k in analysed} == {
            k["name"]: k["tensor_cores"] for k in rows[impl]["kernels"]}, impl


def test_ncu_run_cut_short_keeps_the_implementations_it_finished(tmp_path, monkeypatch):
    """Each implementation's counters reach results.json as its ncu run ends: a run stopped
    during the next one (a time limit, Ctrl-C) loses only that one. ncu itself is faked: it
    writes the recorded CSV of the first implementation, then is interrupted."""
    import argparse
    import subprocess
    import types

    from attnscope.attention import registry
    from attnscope.profile import ncu

    path = _compare_output(tmp_path)
    _ncu_present(monkeypatch)
    for name in ("sdpa_cudnn", "fused"):
        monkeypatch.setitem(registry.IMPLEMENTATIONS, name, types.SimpleNamespace(
            name=name, available=lambda device: (True, ""), backward_variant_of=None))

    def fake_ncu(command, **kwargs):
        log = Path(command[command.index("--log-file") + 1])
        if log.stem == "fused":
            raise KeyboardInterrupt
        log.write_text((NCU / f"{log.stem}.csv").read_text())
        return subprocess.CompletedProcess(command, 0, stdout="")

    monkeypatch.setattr(ncu.subprocess, "run", fake_ncu)
    parser = argparse.ArgumentParser()
    ncu.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--impl", "sdpa_cudnn", "fused"])
    with pytest.raises(KeyboardInterrupt):
        ncu.run(args)
    rows = {row["impl"]: row for row in json.loads(path.read_text())["rows"]}
    assert rows["sdpa_cudnn"]["tensor_cores"] == {"verdict": "yes", "evidence": "counters"}
    assert rows["fused"]["kernels"][0]["tensor_cores"]["evidence"] != "counters"


def _ncu_present(monkeypatch):
    """ncu on PATH and a CUDA GPU, as ncu.run asks for them (neither is real here)."""
    from attnscope.profile import ncu

    monkeypatch.setattr(ncu, "find_ncu", lambda explicit: "ncu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _ncu_faked(monkeypatch, names, csv=None):
    """ncu.run's Nsight Compute faked: `names`, real registry entries, available as on a GPU;
    each ncu command writes the recorded CSV `csv` (default: its implementation's own) to its
    log file. Returns the list the commands are appended to."""
    import subprocess

    from attnscope.attention import registry
    from attnscope.profile import ncu

    _ncu_present(monkeypatch)
    for name in names:
        monkeypatch.setitem(registry.IMPLEMENTATIONS, name, dataclasses.replace(
            registry.IMPLEMENTATIONS[name], available=lambda device: (True, "")))
    commands = []

    def fake_ncu(command, **kwargs):
        commands.append(command)
        log = Path(command[command.index("--log-file") + 1])
        log.write_text((NCU / f"{csv or log.stem}.csv").read_text())
        return subprocess.CompletedProcess(command, 0, stdout="")

    monkeypatch.setattr(ncu.subprocess, "run", fake_ncu)
    return commands


def test_ncu_skips_an_entry_whose_forward_is_anothers(tmp_path, monkeypatch, capsys):
    """ncu profiles forwards: fused_nondeterministic's is fused's (backward_variant_of), so it is
    skipped with the reason, and fused is profiled."""
    import argparse

    from attnscope.profile import ncu

    _compare_output(tmp_path)
    commands = _ncu_faked(monkeypatch, ("fused", "fused_nondeterministic"))
    parser = argparse.ArgumentParser()
    ncu.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--impl", "fused", "fused_nondeterministic"])
    assert ncu.run(args) == 0
    assert [c[c.index("--target") + 1] for c in commands] == ["fused"]
    err = capsys.readouterr().err
    assert "[2/2] fused_nondeterministic: skipped (its forward is fused's" in err


def _ncu_args(*argv):
    import argparse

    from attnscope.profile import ncu
    parser = argparse.ArgumentParser()
    ncu.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_ncu_profiles_forward_and_backward_in_a_fwd_bwd_compare_run(tmp_path, monkeypatch):
    """In the mode of the compare run in --out (here fwd_bwd): every entry is profiled, the one
    that differs only in its backward too, each child runs forward and backward, and ncu takes a
    start/end range (the backward's kernels come from autograd's device thread, which a push/pop
    range of the calling thread does not cover)."""
    from attnscope.profile import ncu

    path = _compare_output(tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "mode": "fwd_bwd"}))
    commands = _ncu_faked(monkeypatch, ("fused", "fused_nondeterministic"), csv="fused")
    args = _ncu_args("--out", str(tmp_path), "--impl", "fused", "fused_nondeterministic")
    assert ncu.run(args) == 0
    assert [c[c.index("--target") + 1] for c in commands] == ["fused", "fused_nondeterministic"]
    for command in commands:
        assert command[command.index("--nvtx-include") + 1] == ncu.RANGE  # no "/": start/end
        assert command[command.index("--mode") + 1] == "fwd_bwd"


def test_ncu_refuses_a_mode_other_than_the_compare_runs(tmp_path, monkeypatch, capsys):
    from attnscope.profile import ncu

    _compare_output(tmp_path)  # a forward-only compare run (its results.json says mode fwd)
    _ncu_present(monkeypatch)
    monkeypatch.setattr(ncu.subprocess, "run", lambda *a, **kw: pytest.fail("ncu ran"))
    assert ncu.run(_ncu_args("--out", str(tmp_path), "--impl", "fused", "--mode",
                             "fwd_bwd")) == 2
    assert "was made with --mode fwd" in capsys.readouterr().err
    assert ncu.run_mode(None, tmp_path / "absent.json") == ("fwd", "")


@pytest.mark.parametrize("argv, says", [
    (["--forwards", "0"], "--forwards must be at least 1, got 0"),
    (["--stall-lines", "0"], "--stall-lines must be at least 1"),
    (["--impl", "fusd"], "fusd"),
    (["--heads", "0"], "--heads must be >= 1"),
])
def test_ncu_refuses_bad_flags_before_looking_for_ncu(argv, says, tmp_path, monkeypatch, capsys):
    # The flags are checked first, on any machine: no ncu and no GPU here.
    from attnscope.profile import ncu
    monkeypatch.setattr(ncu, "find_ncu", lambda explicit: pytest.fail("looked for ncu"))
    assert ncu.run(_ncu_args("--out", str(tmp_path), *argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnscope ncu: error: ") and says in err


def test_ncu_refuses_an_unreadable_results_file_before_profiling(tmp_path, monkeypatch, capsys):
    # A results.json that is no compare run's (cut short, or another file) is refused before
    # ncu runs: its case cannot be read, and the counters could not be merged into it.
    from attnscope.profile import ncu
    path = _compare_output(tmp_path)
    text = path.read_text()
    _ncu_present(monkeypatch)
    monkeypatch.setattr(ncu.subprocess, "run", lambda *a, **kw: pytest.fail("ncu ran"))
    for broken, says in ((text[:len(text) // 2], "cannot be read as a compare run's results"),
                         ("3", "is not a compare run's results"),
                         ('{"sweep": "default", "rows": []}', "a bench file"),
                         ("[1, 2]", "is not a compare run's results")):
        path.write_text(broken)
        assert ncu.run(_ncu_args("--out", str(tmp_path), "--impl", "fused")) == 2
        assert says in capsys.readouterr().err


def test_ncu_names_a_missing_explicit_ncu(tmp_path, monkeypatch, capsys):
    from attnscope.profile import ncu
    assert ncu.run(_ncu_args("--out", str(tmp_path), "--ncu", str(tmp_path / "no-ncu"))) == 2
    assert f"--ncu {tmp_path / 'no-ncu'}: no such executable" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_ncu_child_runs_its_profiled_calls_inside_the_range(mode, monkeypatch):
    """The child (run_target) warms up outside the NVTX range and runs each profiled call
    inside it: with fwd_bwd the backward too, inside a start/end range. On the CPU, with the
    NVTX calls recorded."""
    from attnscope.profile import ncu

    from attnscope.attention import registry

    events, open_ranges = [], []
    nvtx = torch.cuda.nvtx
    monkeypatch.setattr(nvtx, "range_push", lambda name: open_ranges.append(("push", name)))
    monkeypatch.setattr(nvtx, "range_pop", lambda: open_ranges.pop())
    monkeypatch.setattr(nvtx, "range_start", lambda name: open_ranges.append(("start", name))
                        or 7)
    monkeypatch.setattr(nvtx, "range_end", lambda handle: events.append(("end", handle))
                        or open_ranges.pop())
    _child_on_the_cpu(monkeypatch)
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **kw: (
        events.append(("backward", tuple(open_ranges))), grad(*a, **kw))[1])
    naive = registry.IMPLEMENTATIONS["naive"]
    prepare = naive.prepare

    def recorded(*a, **kw):
        forward = prepare(*a, **kw)
        return lambda: (events.append(("forward", tuple(open_ranges))), forward())[1]
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "naive",
                        dataclasses.replace(naive, prepare=recorded))
    args = _ncu_args("--target", "naive", "--batch", "1", "--heads", "2", "--seq", "16",
                     "--head-dim", "8", "--dtype", "fp32", "--forwards", "2", "--mode", mode)
    assert ncu.run_target(args) == 0
    assert open_ranges == []
    if mode == "fwd":  # a push/pop range around each forward
        inside = [("forward", (("push", ncu.RANGE),))] * 2
        assert events == [("forward", ())] * ncu.WARMUP_CALLS + inside
    else:  # a start/end range around each forward and its backward
        warm = [("forward", ()), ("backward", ())] * ncu.WARMUP_CALLS
        inside = [("forward", (("start", ncu.RANGE),)), ("backward", (("start", ncu.RANGE),)),
                  ("end", 7)] * 2
        assert events == warm + inside


def test_ncu_and_kineto_names_of_one_kernel_share_a_key():
    from attnscope.profile import ncu

    pairs = [  # (Kineto, ncu), from the H200 recordings
        ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>"
         "(float*, float const*, int, int, int, bool const*, int, bool)",
         "void <unnamed>::softmax_warp_forward<float, float, float, 10, 0, 0>(T2 *, const T1 *, "
         "int, int, int, const bool *, int, bool)"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<bool>, "
         "std::array<char*, 1ul> >(int, at::native::FillFunctor<bool>, std::array<char*, 1ul>)",
         "void at::vectorized_elementwise_kernel<4, at::FillFunctor<bool>, std::array<char *, 1>>"
         "(int, T2, T3)"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
         "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
         "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(AttentionKernel<bfloat16_t, Sm80, 1, 64, 64, "
         "64, 1, 1>::Params)"),
    ]
    for kineto, ncu_name in pairs:
        assert ncu._name_key(kineto) == ncu._name_key(ncu_name)
        assert ncu.base_name(kineto) == ncu.base_name(ncu_name)
    assert [ncu.base_name(k) for k, _ in pairs] == [
        "softmax_warp_forward", "vectorized_elementwise_kernel",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]
    # another instantiation of the same template keeps a different key
    assert ncu._name_key(pairs[1][0]) != ncu._name_key(pairs[1][0].replace("<bool>", "<float>"))


def test_match_kernels_never_lends_counters_to_another_kernel():
    from attnscope.profile import ncu

    where = "void at::native::elementwise_kernel<128, 2, where_kernel_impl>(int)"
    add = "void at::elementwise_kernel<128, 2, CUDAFunctor_add<float>>(int, T1)"
    gemm = "nvjet_sm90_tst_64x512_64x2_1x2_h_bz_coopB_NNT"
    # one elementwise kernel each, different ones: launch counts differ, so no base-name match
    assert ncu.match_kernels({where: 2.0, gemm: 1.0}, {add: 1, gemm: 1}) == {
        gemm: (gemm, "name")}
    # two per side with one base name and keys that differ: ambiguous, nothing attached
    where2 = "void at::elementwise_kernel<128, 2, where_kernel_impl>(int, T1)"
    fill = "void at::native::elementwise_kernel<128, 4, FillFunctor<float>>(int)"
    assert ncu.match_kernels({fill: 1.0, add.replace("at::", "at::native::"): 1.0},
                             {where2: 1, add.replace("float", "double"): 1}) == {}
    # base name alone, where the demanglers disagree beyond what the key evens out (here a type
    # spelled two ways) and the launch counts agree (two profiled forwards)
    bf16 = where.replace("where_kernel_impl", "where_kernel_impl<c10::BFloat16>")
    nv_bf16 = where2.replace("where_kernel_impl", "where_kernel_impl<__nv_bfloat16>")
    assert ncu.match_kernels({bf16: 2.0, gemm: 1.0}, {nv_bf16: 4, gemm: 2}) == {
        bf16: (nv_bf16, "base name"), gemm: (gemm, "name")}
    assert ncu.match_kernels({bf16: 2.0, gemm: 1.0}, {nv_bf16: 1, gemm: 1}) == {
        gemm: (gemm, "name")}
    # launch order: a sequence that does not line up on base names is not used, nor one whose
    # pairs contradict the names
    order_t = [gemm, where, where]
    assert ncu._order_pairs(order_t, [where2, gemm, where2]) == {}
    assert ncu._order_pairs([gemm, where, fill], [gemm, fill.replace("native::", ""), where2]) == {}
    assert ncu._order_pairs(order_t, [gemm, where2, where2] * 2) == {gemm: gemm, where: where2}
    assert ncu._order_pairs(order_t, [gemm, where2]) == {}  # not whole forwards


class StaticallyLaunchedCudaKernel:
    """Inductor's statically launched kernel as this process holds it after loading: its name
    and hash, the cubin dropped (torch._inductor.runtime.static_triton_launcher)."""

    def __init__(self, name, kernel_hash):
        self.name, self.hash, self.cubin_raw, self.cubin_path = name, kernel_hash, None, None


def test_flex_kernels_are_judged_from_tritons_cache(tmp_path, monkeypatch):
    """FlexAttention's kernel in a plain compare: no CompiledKernel here, but Triton's cache
    holds the PTX its worker process compiled, under the kernel's hash."""
    from torch._inductor.runtime import cache_dir_utils
    from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key

    monkeypatch.setattr(cache_dir_utils, "triton_cache_dir", lambda device: str(tmp_path))
    monkeypatch.setattr(tc, "cuobjdump_path", lambda: None)  # PTX, not SASS, on this machine
    name, kernel_hash = "triton_tem_fused_flex_attention_0", "ab" * 32
    folder = tmp_path / triton_hash_to_path_key(kernel_hash)
    folder.mkdir()
    (folder / f"{name}.ptx").write_text(PTX_HOPPER)
    launcher = StaticallyLaunchedCudaKernel(name, kernel_hash)  # alive: gc finds it
    got = compiled.triton_verdicts([name, "not_compiled_here"])
    assert list(got) == [name]
    assert (got[name]["verdict"], got[name]["evidence"]) == ("yes", "ptx")
    del launcher


def _child_on_the_cpu(monkeypatch):
    """run_target here: the inputs it asks for on CUDA drawn on the CPU, no CUDA sync."""
    from attnscope.profile import scenarios

    case_inputs = scenarios.case_inputs

    def on_the_cpu(c, dtype, device, seed):
        assert device == "cuda"  # what the child asks for, as compare on a GPU
        return case_inputs(c, dtype, "cpu", seed=seed)
    monkeypatch.setattr(scenarios, "case_inputs", on_the_cpu)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


# --- the case ncu profiles: compare's --------------------------------------------------------

# Cases of every scenario in compare's flags, each with a window or a softcap (the scenarios'
# presets are the CUDA ones ncu resolves; these stay small where the flags allow).
CASES = [
    [],  # compare's default: the blog's prefill shape
    ["--scenario", "decode", "--window", "4095,0"],
    ["--scenario", "chunked", "--batch", "2", "--heads", "4", "--q-len", "24", "--kv-len", "100",
     "--head-dim", "16", "--kv-heads", "2", "--softcap", "30"],
    ["--scenario", "varlen", "--heads", "4", "--head-dim", "16", "--kv-heads", "2",
     "--window=-1,0", "--softcap", "2.5"],  # a left of -1 with causal: no window at all
    ["--scenario", "paged", "--batch", "2", "--heads", "4", "--q-len", "1", "--kv-len", "40",
     "--head-dim", "16", "--kv-heads", "2", "--page-size", "16", "--window=5,0",
     "--softcap", "4"],
    ["--q-len", "40", "--kv-len", "100", "--window", "7,0"],  # unequal lengths, no scenario
]


@pytest.mark.parametrize("flags", CASES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_ncu_child_args_carry_the_case(flags, dtype):
    """child_args gives the child the case as compare's flags: parsed by ncu's parser and
    resolved as compare resolves them on CUDA, they are the parent's case, dtype and mode."""
    from attnscope.profile import compare, ncu

    case = compare.resolve_case(_ncu_args(*flags), "cuda")
    parent = _ncu_args("--forwards", "3", *flags)
    command = ncu.child_args(parent, "fused", case, dtype, "fwd_bwd")
    assert command[:3] == [sys.executable, "-m", "attnscope.profile.ncu"]
    child = _ncu_args(*command[3:])
    assert (child.target, child.dtype, child.mode, child.forwards) == ("fused", dtype, "fwd_bwd", 3)
    assert compare.resolve_case(child, "cuda") == case


@pytest.fixture(scope="module")
def paged_run(tmp_path_factory):
    """A compare run written by compare itself on the CPU: paged, a window and a softcap (naive
    takes no GQA, so its row is `unsupported` and nothing is profiled), its results.json then
    marked as made on CUDA (ncu refuses a CPU run's: test_ncu_refuses_a_cpu_run)."""
    from attnscope.profile import runs
    from attnscope.profile.cli import main

    out = tmp_path_factory.mktemp("paged_run")
    argv = ["--scenario", "paged", "--window", "5,0", "--softcap", "4", "--impl", "naive"]
    assert main(["compare", "--device", "cpu", *argv, "--out", str(out)]) == 0
    results = runs.resolve(out) / runs.RESULTS
    data = json.loads(results.read_text())
    assert data["device"] == "cpu"
    results.write_text(json.dumps(dict(data, device="cuda")))
    return out, results


def test_ncu_refuses_a_cpu_run(paged_run, tmp_path):
    """A compare run made on the CPU has no GPU kernels in its rows: ncu refuses it, whatever
    the flags, rather than merge counters of another device's call."""
    from attnscope.profile import ncu

    _, results = paged_run
    cpu = tmp_path / "results.json"
    cpu.write_text(json.dumps(dict(json.loads(results.read_text()), device="cpu")))
    for flags in ([], PAGED_CPU):
        with pytest.raises(ValueError, match=re.escape(f"the compare run in {tmp_path} ran on "
                                                       "the CPU")):
            ncu.run_case(_ncu_args(*flags), cpu)


# The CPU preset of paged with its window and softcap, in explicit flags (ncu resolves on CUDA)
PAGED_CPU = ["--batch", "2", "--heads", "4", "--q-len", "1", "--kv-len", "200", "--head-dim",
             "32", "--kv-heads", "2", "--scenario", "paged", "--page-size", "16", "--window",
             "5,0", "--softcap", "4"]


def test_ncu_profiles_the_case_of_the_compare_run(paged_run):
    """No case flag: the case the compare run in --out profiled, as its results.json records it
    (and its dtype); case flags that give that case too are accepted."""
    from attnscope.profile import compare, ncu
    from attnscope.profile.sweeps import case

    _, results = paged_run
    run_case = compare.resolve_case(_ncu_args(*PAGED_CPU[10:]), "cpu")
    assert run_case == dataclasses.replace(case(2, 4, 1, 32, kv_heads=2, kv_len=200,
                                                page_size=16), window=(5, 0), softcap=4.0)
    assert ncu.run_case(_ncu_args(), results) == (run_case, "fp32")
    assert ncu.run_case(_ncu_args(*PAGED_CPU), results) == (run_case, "fp32")
    assert ncu.run_case(_ncu_args(*PAGED_CPU, "--dtype", "fp32"), results) == (run_case, "fp32")


def test_ncu_reads_a_window_recorded_before_long_windows_read_as_none(paged_run, tmp_path):
    # a run written before a window side as long as the queries and keys together read as
    # none recorded it as given; ncu takes that run's case as compare would make it now
    from attnscope.profile import compare, ncu

    _, results = paged_run
    old = tmp_path / "results.json"
    old.write_text(json.dumps(dict(json.loads(results.read_text()), window=[4096, 0])))
    made, _ = compare.recorded_case(json.loads(old.read_text()))
    assert made.window is None
    assert ncu.run_case(_ncu_args(), old)[0] == made


@pytest.mark.parametrize("flags, says", [
    (["--scenario", "paged"], "pages of 128 keys"),  # the CUDA preset: 64 x 8192 keys
    (PAGED_CPU[:-2], "pages of 16 keys, window (5, 0): drop"),  # no softcap
    (PAGED_CPU[:-4] + ["--window", "6,0"] + PAGED_CPU[-2:], "window (6, 0), softcap 4"),
    (["--seq", "64"], "prefill shape (8, 16, 64, 64)"),
])
def test_ncu_refuses_a_case_other_than_the_compare_runs(flags, says, paged_run):
    from attnscope.profile import ncu

    _, results = paged_run
    with pytest.raises(ValueError) as e:
        ncu.run_case(_ncu_args(*flags), results)
    message = str(e.value)
    recorded = ("paged shape (2, 4, 1, 32) [batch, heads, q_len, head_dim], 200 keys, 2 K/V "
                "heads, pages of 16 keys, window (5, 0), softcap 4")
    assert message.startswith(f"the compare run in {results.parent} profiled {recorded}; "
                              "the flags give ")
    assert says in message.split("the flags give ")[1]


def test_ncu_refuses_a_dtype_other_than_the_compare_runs(paged_run):
    from attnscope.profile import ncu

    _, results = paged_run
    with pytest.raises(ValueError, match="profiled fp32 inputs; --dtype bf16 asks for other"):
        ncu.run_case(_ncu_args("--dtype", "bf16"), results)


def test_ncu_case_without_a_compare_run(tmp_path):
    """No results.json: the flags, defaulting as compare's do on CUDA; none: today's default
    (the blog's prefill shape, bf16). A results.json from before the scenario fields reads as
    the prefill run it was."""
    from attnscope.profile import compare, ncu
    from attnscope.profile.inputs import SHAPES
    from attnscope.profile.sweeps import case

    absent = tmp_path / "results.json"
    assert ncu.run_case(_ncu_args(), absent) == (case(*SHAPES["cuda"]), "bf16")
    flags = ["--scenario", "decode", "--q-len", "4", "--window", "100,0", "--dtype", "fp16"]
    decode = compare.resolve_case(_ncu_args(*flags), "cuda")
    assert (decode.batch, decode.seq, decode.keys, decode.kv_heads, decode.window) == (
        64, 4, 8192, 8, (100, 0))
    assert ncu.run_case(_ncu_args(*flags), absent) == (decode, "fp16")
    old = _compare_output(tmp_path)  # H200 seed run: shape and dtype only
    assert "scenario" not in json.loads(old.read_text())
    assert ncu.run_case(_ncu_args(), old) == (case(8, 16, 1024, 64), "bf16")
    assert ncu.run_case(_ncu_args("--seq", "1024"), old) == (case(8, 16, 1024, 64), "bf16")
    with pytest.raises(ValueError, match="--seq sets both lengths"):  # compare's own refusal
        ncu.run_case(_ncu_args("--seq", "8", "--q-len", "4"), absent)


def test_ncu_refuses_packed_lengths_its_child_cannot_rebuild(tmp_path):
    """A CPU compare run's packed lengths are not varlen's on CUDA, which the child's flags
    give: refused rather than profiled on other lengths."""
    from attnscope.profile import ncu
    from attnscope.profile.sweeps import VARLEN_LENGTHS

    path = _compare_output(tmp_path)
    data = json.loads(path.read_text())
    lengths = list(VARLEN_LENGTHS["cpu"])
    data.update(shape={"batch": len(lengths), "heads": 2, "seq": max(lengths), "head_dim": 32},
                scenario="varlen", kv_len=max(lengths), kv_heads=2, seqlens=lengths,
                page_size=None, dtype="fp32")
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(f"packed lengths {lengths}; compare's flags")):
        ncu.run_case(_ncu_args(), path)


def test_ncu_run_profiles_the_compare_runs_case(paged_run, monkeypatch, capsys):
    """The command end to end, ncu faked: the progress names the case, an entry the case does
    not suit is skipped with compare's reason, and the child gets the run's case."""
    from attnscope.profile import compare, ncu

    out, results = paged_run
    commands = _ncu_faked(monkeypatch, ("naive", "sdpa_math", "fused"))
    assert ncu.run(_ncu_args("--out", str(out), "--impl", "naive", "sdpa_math", "fused")) == 0
    err = capsys.readouterr().err
    assert ("attnscope ncu: 3 implementations, paged shape (2, 4, 1, 32) [batch, heads, q_len, "
            "head_dim], 200 keys, 2 K/V heads, pages of 16 keys, window (5, 0), softcap 4, fp32, "
            "fwd") in err
    assert "[1/3] naive: skipped (takes no K/V with fewer heads than q" in err
    assert "[2/3] sdpa_math: skipped (reads no paged KV cache" in err
    (command,) = commands
    child = _ncu_args(*command[command.index("-m") + 2:])
    assert child.target == "fused" and child.dtype == "fp32"
    assert compare.resolve_case(child, "cuda") == ncu.run_case(_ncu_args(), results)[0]


def test_ncu_run_refuses_case_flags_of_another_case(paged_run, monkeypatch, capsys):
    from attnscope.profile import ncu

    out, _ = paged_run
    _ncu_present(monkeypatch)
    monkeypatch.setattr(ncu.subprocess, "run", lambda *a, **kw: pytest.fail("ncu ran"))
    assert ncu.run(_ncu_args("--out", str(out), "--impl", "fused", "--scenario", "decode")) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnscope ncu: error: the compare run in ")
    assert "the flags give decode shape" in err


@pytest.mark.parametrize("flags, entry", [
    (CASES[4], "prepare_paged"),
    (CASES[3], "prepare_varlen"),
    (CASES[2], "prepare"),
])
def test_ncu_child_builds_compares_inputs_and_call(flags, entry, monkeypatch):
    """The child prepares the call capture prepares for compare: the case's inputs from seed 0
    (scenarios.case_inputs), packed or paged, causal, with the case's window and softcap."""
    from attnscope.attention import registry
    from attnscope.profile import compare, ncu, scenarios

    _child_on_the_cpu(monkeypatch)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: None)
    calls = []

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return lambda: torch.zeros(1)
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "fused", dataclasses.replace(
        registry.IMPLEMENTATIONS["fused"], **{entry: recorded}))
    args = _ncu_args("--target", "fused", *flags, "--dtype", "fp32")
    assert ncu.run_target(args) == 0
    case = compare.resolve_case(args, "cuda")
    inputs = scenarios.case_inputs(case, torch.float32, "cuda", seed=0)  # on the CPU here
    if entry == "prepare_paged":
        expected = (inputs.qkv[0], *inputs.paging)
    else:
        expected = (*inputs.qkv, *(inputs.packing or ()))
    (got, kwargs), = calls
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a == b if isinstance(a, int) else torch.equal(a, b)
    options = scenarios.options(case)
    assert options  # every one of these cases has a window or a softcap
    assert kwargs == ({"causal": True, **options} if entry != "prepare" else options)
