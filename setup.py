from pathlib import Path

from setuptools import find_packages, setup

about = {}
exec(Path("attnscope/_version.py").read_text(), about)

setup(
    name="attnscope",
    version=about["__version__"],
    description="A fused causal-attention kernel in Triton and a profiler driver that compares it "
    "with PyTorch's attention implementations.",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["attnscope", "attnscope.*"]),
    # torch first and pinned by the user (see README); a range here so pip never swaps it.
    # numpy: Triton's interpreter, which runs the kernels on machines without a GPU, needs it.
    install_requires=["torch>=2.6", "triton>=3.4", "einops>=0.7", "numpy"],
    extras_require={
        # The report's tests render real charts and highlighted source; the transformers
        # backend's tests build tiny models.
        "test": ["pytest>=8", "matplotlib>=3.8", "pygments>=2.15", "transformers>=5.4"],
        "report": ["matplotlib>=3.8", "pygments>=2.15"],
        "hub": ["kernels>=0.4"],
        # The peers the driver compares against: FlashAttention-4 (CuTe DSL, Hopper/Blackwell).
        # flash-attn 2 is a peer too but not here: it needs a CUDA source build against the
        # installed torch, `pip install flash-attn --no-build-isolation`.
        "peers": ["flash-attn-4"],
        # 5.4 gave the mask interface query lengths and offsets as integers (earlier: a tensor).
        "transformers": ["transformers>=5.4"],
    },
    entry_points={"console_scripts": ["attnscope = attnscope.profile.cli:main"]},
)
