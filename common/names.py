"""Canonical names for the sweep axes. Lower case everywhere; one place to extend."""

ENGINES = ("hf", "llamacpp", "mlx", "vllm", "trtllm")

# Float formats plus the quant names the engines use (llama.cpp types, MLX
# group-wise ints, GPU formats). A backend declares the subset it runs.
DTYPES = (
    "fp32",
    "bf16",
    "f16",
    "q8_0",
    "q6_k",
    "q5_k_m",
    "q5_0",
    "q4_k_m",
    "q4_0",
    "q4_1",
    "q3_k_m",
    "q2_k",
    "q8_g64",
    "q4_g64",  # MLX group-wise affine, group size 64
    "int8",
    "int4",
    "fp8",
    "nvfp4",
    "awq",
    "gptq",
)

ATTENTION = (
    "eager",
    "sdpa",
    "flash_attention_2",
    "flex_attention",  # transformers
    "sdpa_math",
    "sdpa_flash",
    "sdpa_efficient",
    "sdpa_cudnn",  # PyTorch's SDPA kernels, one pinned (HF)
    "flash_attn",
    "flashinfer",
    "triton_attn",
    "flex",  # vLLM backends (lower-cased)
    "default",  # the engine's own choice (llama.cpp, MLX, TensorRT-LLM)
)

# Device classes a cell can ask for; placement maps them onto nodes.
DEVICES = (
    "cpu",
    "cuda",
    "h100",
    "h200",
    "b200",
    "sm120",
    "mi300x",
    "rocm",
    "apple-m1",
    "apple-m2",
    "apple-m3",
    "apple-m4",
    "mps",
)

# Keys of one cell (singular), as used in include / exclude / reference.
CELL_AXES = ("model", "engine", "dtype", "attention", "tp", "device")
# Spec key (plural where the design card says so) -> cell key.
SPEC_AXES = {
    "models": "model",
    "engines": "engine",
    "dtypes": "dtype",
    "attention": "attention",
    "tp": "tp",
    "devices": "device",
}
