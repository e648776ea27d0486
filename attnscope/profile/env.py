"""The `env` block every result file carries: host, GPU, driver, clocks and software versions."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import socket
import subprocess

import torch

# bf16 dense matmul ceiling measured on our H200 (8192^3, random data; see
# ../shared/data/h200_peers.md and results/h200). Used for "% of peak" when the GPU matches.
MEASURED_PEAK_TFLOPS = {"NVIDIA H200": 809.0}


def _nvidia_smi(query: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def collect_env() -> dict:
    """Everything needed to say where and with what a number was measured."""
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") == "1",
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "driver": _nvidia_smi("driver_version"),
            "clocks_mhz": _nvidia_smi("clocks.sm,clocks.mem,clocks.max.sm"),
            "power_limit": _nvidia_smi("power.limit"),
            "measured_bf16_peak_tflops": MEASURED_PEAK_TFLOPS.get(props.name),
        }
        env["gpu"] = gpu
    return env
