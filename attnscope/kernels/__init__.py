"""The kernels and their launches: the Triton forward (attention_fwd.py), the Gluon forward for
Hopper (attention_fwd_hopper.py), the backward (attention_bwd.py, and attention_bwd_hopper.py on
sm_90), the split-KV decode kernel (attention_decode.py), their shared helpers (common.py,
tile_schedule.py, gluon_compat.py), the launch cache (launch.py) and dispatch.py, which
attention/fused.py calls. Nothing here imports attnscope.attention or attnscope.profile."""
