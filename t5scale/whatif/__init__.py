"""What a run would need and how fast it would go on devices that are not here.

A ZeRO stage weak-scaled onto N devices (weak_scaling.py) is compiled for a target
(compile.py, t5scale/target.py), planned (plan.py: memory per device, collectives) or timed
(simulate.py) on the hardware a cluster file names (hardware.py): a GPU cluster
(gpu_cluster.py; NCCL's collectives in nccl.py, kernels in gpu_step.py, the CPU path in
step_time.py and compute.py) or a TPU pod (tpu_pod.py; ICI and DCN in ici_dcn.py, operations in
tpu_step.py), both adding up a program's time in program_time.py. The study drives it; it
never reaches up into the study.
"""
