"""What a run would need and how fast it would go on devices that are not here.

One wing for every what-if question: a ZeRO stage weak-scaled onto N devices
(weak_scaling.py), compiled for one compile target (compile.py, t5scale/target.py), planned
(plan.py: memory per device, collectives) or timed by the cluster model (simulate.py, with
hardware.py, collectives.py, compute.py, step_time.py and gpu_step.py). The study drives it; it
never reaches up into the study.
"""
