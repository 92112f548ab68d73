#!/usr/bin/env bash
# usage: [PY=python] bench/same_programs.sh SRC OUT — the step_analysis.json, plan --json and simulate --json outputs
# (CPU, GPU cluster and TPU pod) that issues 48 and 61 asked to stay byte-identical (compile_time_s aside), from source tree SRC
# (bench/compare_programs.py compares two OUTs; docs/benchmarks.md, 2026-11-27, fifth).
set -u
SRC=$1; OUT=$2; mkdir -p $OUT; rm -rf $OUT/*
PY=${PY:-python}
export PYTHONPATH=$SRC XDG_CACHE_HOME=$OUT/cache JAX_COMPILATION_CACHE_DIR= 
cd $SRC
T="$PY -m t5scale.cli"
COMMON="--gin_file=gin/models/mt5_tiny.gin --gin.INPUT_LENGTH=32 --gin.TARGET_LENGTH=8 --gin.DATA_SOURCE='synthetic' --gin.CHECKPOINT_EVERY=0 --gin.TRAIN_STEPS=1"
$T train $COMMON --gin_file=gin/zero/stage2.gin --gin.MODEL_DIR=$OUT/a > $OUT/a.log 2>&1
$T train $COMMON --gin_file=gin/zero/stage3.gin --gin_file=gin/precision/mixed.gin --gin.MICRO_BATCHES=2 --gin.BATCH_SIZE=16 --gin.MODEL_DIR=$OUT/b > $OUT/b.log 2>&1
$T train $COMMON --gin_file=gin/zero/stage1.gin --gin.ParallelConfig.replica=2 --gin.ReplicaSyncConfig.mode="'diloco'" --gin.ReplicaSyncConfig.every=2 --gin.MODEL_DIR=$OUT/c > $OUT/c.log 2>&1
$T train $COMMON --gin_file=gin/zero/stage0.gin --gin.ParallelConfig.tensor=2 --gin.ModelConfig.remat="'auto'" --gin.MODEL_DIR=$OUT/d > $OUT/d.log 2>&1
for x in a b c d; do cp $OUT/$x/step_analysis.json $OUT/step_analysis_$x.json; done
$T plan --json $COMMON --gin.DEVICES=4 > $OUT/plan_cpu.json 2> $OUT/plan_cpu.log
$T plan --json $COMMON --gin_file=gin/clusters/h100.gin --gin_file=gin/precision/mixed.gin --gin.DEVICES=16 > $OUT/plan_gpu.json 2> $OUT/plan_gpu.log
$T simulate --json $COMMON --gin_file=gin/clusters/h100.gin --gin_file=gin/precision/mixed.gin --gin.SimulateConfig.nodes=[1,2] --gin.SimulateConfig.stages=[1,3] --gin.SimulateConfig.diloco_every=[4] > $OUT/simulate_gpu.json 2> $OUT/simulate_gpu.log
$T simulate --json $COMMON --gin_file=gin/clusters/h100.gin --gin.SimulateConfig.compiler="'cpu'" --gin.SimulateConfig.nodes=[1,2] --gin.SimulateConfig.stages=[0,2] --cpu_devices=16 > $OUT/simulate_cpu.json 2> $OUT/simulate_cpu.log
TPU="--gin_file=gin/clusters/tpu_v5e.gin --gin.TpuPodConfig.slice='v5e-8'"
$T plan --json $COMMON $TPU --gin.PlanConfig.micro_batch_size=2 > $OUT/plan_tpu.json 2> $OUT/plan_tpu.log
$T simulate --json $COMMON $TPU --gin_file=gin/precision/mixed.gin --gin.SimulateConfig.micro_batch_size=2 --gin.SimulateConfig.nodes=[1,2] --gin.SimulateConfig.stages=[1,3] > $OUT/simulate_tpu.json 2> $OUT/simulate_tpu.log
echo captured
