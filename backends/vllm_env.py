"""The environment of a vLLM cell's actor and workers, and the executor its ranks run in.

Tensor parallelism runs in vLLM's own workers, one of two ways (spec option `vllm_executor`):
  mp   (default) vLLM's worker processes on the actor's node; the one actor reserves all tp
       devices / threads, so Ray sees no group at all.
  ray  vLLM's Ray executor, for ranks that must be Ray actors (e.g. across nodes). The runner makes
       the cell's STRICT_PACK group and starts this actor inside it with
       placement_group_capture_child_tasks; vLLM finds it with get_current_placement_group() and
       puts one worker per bundle there instead of creating a group inside ours (that deadlocks:
       the inner group waits for devices the outer one holds). vLLM's CPU platform has no Ray
       device key, so this needs a GPU.
What reaches the workers is chosen, not inherited blindly: the actor's runtime_env (this
interpreter plus the variables worker_env lists; Ray passes it on to child actors). vLLM's Ray
executor also copies the driver's whole environment to its workers (as defaults); what was set
for this one actor (thread counts, our own LOGIT_MATRIX_* switches) is withheld (keep_back).
"""

from __future__ import annotations

import os
from typing import Any

from common.stack import StackDesc


def executor(options: dict[str, Any] | None) -> str:
    """The cell's vllm_executor option (values checked by the spec): mp unless ray is asked for."""
    return (options or {}).get("vllm_executor", "mp")


def worker_env(stack: StackDesc, threads: int) -> dict[str, str]:
    """The environment the cell's actor (and through it vLLM's workers) gets: an explicit list."""
    # In-process engine core: the hook and the captured states live in this actor's process;
    # apply_model sends backends/vllm_worker.py's functions to every rank, which needs pickle over vLLM's RPC.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    if stack.device == "cpu":  # CPU-platform knobs only where they mean something
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": str(threads),
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            }
        )
    if stack.opts.get("deterministic"):  # vLLM's batch-invariant kernels (docs: batch invariance)
        env["VLLM_BATCH_INVARIANT"] = "1"
    if executor(stack.opts) == "ray":
        # one device per worker, worker i in bundle i of our group (not "the first bundles with a GPU")
        tp = stack.tp
        env.update({"VLLM_RAY_PER_WORKER_GPUS": "1", "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, range(tp)))})
    return env


# Set for the driver actor only (Ray sizes OMP_NUM_THREADS from its one CPU): not the workers'.
HELD_BACK = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def keep_back(environ: dict[str, str]) -> list[str]:
    """Names vLLM's Ray executor must not copy from this actor to its workers; registers them.

    vLLM reads its documented exclusion list (VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json)
    once, into vllm.ray.ray_env.RAY_NON_CARRY_OVER_ENV_VARS; adding to that set here keeps the
    user's own file untouched."""
    from vllm.ray import ray_env

    names = sorted(k for k in environ if k in HELD_BACK or k.startswith("LOGIT_MATRIX_"))
    ray_env.RAY_NON_CARRY_OVER_ENV_VARS.update(names)
    return names
