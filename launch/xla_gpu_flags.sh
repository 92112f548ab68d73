# XLA flags for t5scale on NVIDIA GPUs, sourced by launch/slurm.sbatch and copied into the
# Kubernetes manifest and given to compile-only GPU programs (t5scale/xla_gpu.py LAUNCH_FLAGS;
# tests/test_launch.py checks that the three agree and that the jaxlib in
# use knows every flag: XLA refuses unknown ones).
#
# ZeRO's collectives (the gradient reduce-scatter or all-reduce, the parameter all-gathers of
# stage 3) pay off only if they overlap with compute:
# - the latency-hiding scheduler moves collectives so that they run beside independent compute;
# - the pipelined collectives start a layer's all-gather (stage 3) or reduce-scatter in the
#   previous iteration of the scanned layer loop, and double buffering gives them the room;
# - the combine thresholds (128 MiB) merge the many per-parameter collectives into few large
#   ones, which use the network's bandwidth instead of paying its latency each time.
T5SCALE_XLA_GPU_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_enable_pipelined_all_gather=true \
--xla_gpu_enable_pipelined_reduce_scatter=true \
--xla_gpu_enable_pipelined_all_reduce=true \
--xla_gpu_enable_while_loop_double_buffering=true \
--xla_gpu_all_gather_combine_threshold_bytes=134217728 \
--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728 \
--xla_gpu_all_reduce_combine_threshold_bytes=134217728"
# The user's own XLA_FLAGS last: XLA keeps the last of a repeated flag, so theirs win.
export XLA_FLAGS="${T5SCALE_XLA_GPU_FLAGS} ${XLA_FLAGS:-}"
