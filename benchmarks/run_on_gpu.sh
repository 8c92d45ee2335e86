#!/usr/bin/env bash
# Run named GPU sections in one go, each under its own time limit. Logs go to $LOGS and, tarred, to $OUT/logs.tgz
# (the device tool returns at most 8 files).
#
#   bash benchmarks/run_on_gpu.sh env tests_fp8 bench_fp8 train_dense ...
#
# A failing or timed-out section is reported and the next one still runs. The last lines of each section's log are
# printed at the end, so the summary tables of every section come last.
set -u
OUT=${OUT:-/tmp/mx_jax_gpu}
LOGS=${LOGS:-/tmp/mx_jax_gpu_logs}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 MX_JAX_TEST_GPU=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
MOE="--config configs/mixtral_8x7b.yaml model.n_layers=2 data.source=embedded data.seq_len=4096 mesh.fsdp=1"
CTX8B="--config configs/llama3_8b.yaml model.n_layers=8 data.source=embedded data.batch_size=1 model.remat=save_matmuls model.scan_layers=false mesh.data=1 mesh.fsdp=1 mesh.expert=1"  # long sequences, 2 GPUs
W64=tile_m=64,tile_n=256,wg_split=m,stages=4,epi_tile_m=64,epi_tile_n=32,delay_release=0,cluster=m,ring=static  # fp8 AUTO_DEFAULT
DENSE8B="--config configs/llama3_8b.yaml model.n_layers=8 data.source=embedded data.seq_len=8192 data.batch_size=1 model.remat=none"
LAYOUT8B="--config configs/llama3_8b.yaml model.n_layers=8 data.source=embedded data.seq_len=8192 data.batch_size=1 mesh.fsdp=1"  # the configs' scanned save_matmuls layout

section() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  echo "$name rc=$rc $((SECONDS - t0))s" >> "$LOGS/summary.txt"
}

for s in "$@"; do
  case $s in
    env) section env 120 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c 'import jax, flax, optax, orbax.checkpoint as o; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())'" ;;
    tests_fp8) section tests_fp8 420 $PY -m pytest -q -m gpu -x tests/test_fp8_matmul.py tests/test_quantize.py tests/test_quant_recipes.py ;;
    tests_mxcast) section tests_mxcast 300 $PY -m pytest -q -m gpu tests/test_mx_format.py tests/test_mx_quantize.py ;;
    tests_mx) section tests_mx 420 $PY -m pytest -q -m gpu tests/test_mx_matmul.py tests/test_mx_linear.py ;;
    tests_moe) section tests_moe 420 $PY -m pytest -q -m gpu tests/test_grouped_matmul.py tests/test_grouped_linear.py tests/test_moe.py ;;
    bench_fp8) section bench_fp8 420 $PY -m pallas_kernels.bench fp8 ;;
    bench_fp8_quick) section bench_fp8_quick 240 $PY -m pallas_kernels.bench fp8 --quick ;;
    bench_mx) section bench_mx 420 $PY -m pallas_kernels.bench mx ;;
    bench_mx_quick) section bench_mx_quick 200 $PY -m pallas_kernels.bench mx --quick ;;
    bench_grouped) section bench_grouped 420 $PY -m pallas_kernels.bench grouped ;;
    bench_grouped_bf16) section bench_grouped_bf16 300 $PY -m pallas_kernels.bench_grouped --dtypes bf16 --no-ffn ;;
    bench_fp8_cublas) section bench_fp8_cublas 450 env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" $PY -m pallas_kernels.bench fp8 ;;
    fp8_cube) section fp8_cube 120 env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" $PY -m pallas_kernels.bench fp8 --shapes cube --config stages=4,epi_tile_m=64,epi_tile_n=64 --config stages=4,epi_tile_m=64,epi_tile_n=64,delay_release=0 --config stages=4,epi_tile_m=64,epi_tile_n=64,cluster=n --config tile_m=64,tile_n=256,wg_split=m,stages=4,epi_tile_m=64,epi_tile_n=64 --config tile_m=64,tile_n=256,wg_split=m,delay_release=0 --config delay_release=0,cluster=n --config stages=4,epi_tile_m=64,epi_tile_n=64,grid_tile_width=16 ;;
    layout) section layout 540 $PY benchmarks/bench_train.py --out "$LOGS" --steps 16 --log-every 4 --base "--config configs/llama3_8b.yaml model.n_layers=4 data.source=embedded data.seq_len=8192 data.batch_size=2 mesh.data=1 mesh.fsdp=2 quant.recipe=fp8_rowwise" --variant one_process: --variant two_processes:%2 --variant one_process_again: --variant two_processes_again:%2 ;;  # 2 GPUs: one process of both vs one per GPU
    tests_multihost) section tests_multihost 400 $PY -P -m pytest -x -q -m gpu tests/test_multihost.py ;;  # >= 2 GPUs
    tests_cli) section tests_cli 600 $PY -P -m pytest -x -q -m gpu tests/test_cli.py ;;  # on 2 GPUs: the expert-parallel step from the compile cache
    tests_context) section tests_context 240 $PY -m pytest -q -m gpu tests/test_context_parallel.py ;;
    bench_context) section bench_context 420 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_context.py ${CONTEXT_SEQS:+--seqs $CONTEXT_SEQS} ;;
    train_context) section train_context 330 $PY benchmarks/bench_train.py --out "$LOGS" --steps 6 --log-every 1 --base "$CTX8B" --variant ctx2_32k:"data.seq_len=32768 mesh.context=2" --variant one_gpu_32k:"data.seq_len=32768 mesh.context=1 +CUDA_VISIBLE_DEVICES=0" --variant ctx2_64k:"data.seq_len=65536 mesh.context=2" ;;
    profile_context) section profile_context 240 $PY -m mx_jax.train $CTX8B data.seq_len=32768 mesh.context=2 steps=7 log.profile_steps=2 log.profile_from=5 ckpt.every_steps=-1 log.eval_every_steps=-1 log.progress=false log.tensorboard=false run_dir=/tmp/mx_jax_profile_context ;;
    tests_a2a) section tests_a2a 200 $PY -m pytest -q -m gpu -x tests/test_all_to_all.py tests/test_row_exchange.py ;;
    dispatch_tune) section dispatch_tune 240 $PY benchmarks/bench_dispatch.py --tune ;;
    train_final) section train_final 420 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out "$LOGS" --steps 20 --base "$DENSE8B model.scan_layers=false" --variant bf16: --variant fp8_rowwise:quant.recipe=fp8_rowwise ;;
    train_layout) section train_layout 420 $PY benchmarks/bench_train.py --out "$LOGS" --steps 20 --base "$DENSE8B" --variant bf16_scan: --variant bf16_unrolled:model.scan_layers=false --variant fp8_rowwise_unrolled:"model.scan_layers=false quant.recipe=fp8_rowwise" ;;
    smi_log) nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 250 > "$LOGS/smi.csv" 2>&1 &
             echo "=== smi_log: clocks and power every 250 ms to $LOGS/smi.csv (background)" ;;
    profile_replay) section profile_replay 360 $PY benchmarks/profile_step.py --steps 3 --top 40 --replay --dump "$LOGS/prof_bf16" ${DENSE8B} model.scan_layers=false ;;
    profile_fp8_unrolled) section profile_fp8_unrolled 300 $PY benchmarks/profile_step.py --steps 3 --top 40 --dump "$LOGS/prof_fp8" ${DENSE8B} model.scan_layers=false quant.recipe=fp8_rowwise ;;
    train_flags) section train_flags 420 $PY benchmarks/bench_train.py --out "$LOGS" --steps 20 --base "$DENSE8B model.scan_layers=false" --variant bf16: --variant bf16_cublaslt:@--xla_gpu_enable_cublaslt=true --variant bf16_autotune0:@--xla_gpu_autotune_level=0 ;;
    train_confirm) section train_confirm 480 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out "$LOGS" --steps 30 --base "$DENSE8B model.scan_layers=false" --variant bf16: --variant fp8_rowwise:quant.recipe=fp8_rowwise --variant bf16_again: --variant fp8_rowwise_again:quant.recipe=fp8_rowwise ;;
    gemm_clock) section gemm_clock 400 env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" $PY benchmarks/gemm_clock.py --k-sweep ;;
    ffn) section ffn 240 env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" $PY -m pallas_kernels.bench fp8 --shapes none --quick ;;
    ncu_gemm) section ncu_gemm 300 bash -c "env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false ncu --clock-control none --csv -k 'regex:mosaic|nvjet|gemm' --metrics \$($PY benchmarks/ncu_gemm.py metrics) $PY benchmarks/ncu_gemm.py run 8192x8192x8192,8192x14336x4096,4096x14336x8192 delay_release=0,cluster=m $W64 stages=4,epi_tile_m=64,epi_tile_n=64,delay_release=0,cluster=m,ring=static tile_m=64,tile_n=256,wg_split=m,delay_release=0,cluster=m > $LOGS/ncu_gemm.csv && $PY benchmarks/ncu_gemm.py table $LOGS/ncu_gemm.csv" ;;
    ncu_grouped) section ncu_grouped 300 bash -c "env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false XLA_PYTHON_CLIENT_ALLOCATOR=platform ncu --clock-control none --print-units base --csv -k 'regex:mosaic|nvjet|gemm|xmma' --metrics \$($PY benchmarks/ncu_gemm.py metrics --memory) $PY benchmarks/ncu_gemm.py run-grouped --problem ${NCU_PROBLEM:-mixtral} default > $LOGS/ncu_grouped.csv && $PY benchmarks/ncu_gemm.py table $LOGS/ncu_grouped.csv" ;;
    sustained) section sustained 590 env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" $PY benchmarks/gemm_clock.py --sustained-sweep --sweep-seconds 1.0 --config delay_release=0,cluster=m --config delay_release=0 --config $W64 --config ${W64/,cluster=m/} ;;
    sustained_grouped) section sustained_grouped 300 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/gemm_clock.py --sustained-sweep --grouped --sweep-seconds 2 --config default --config cluster=n --config stages=4,epi_tile_n=64 --config stages=4,epi_tile_n=64,cluster=n ;;
    sustained_grouped_ab) section sustained_grouped_ab 300 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/gemm_clock.py --sustained-sweep --grouped --dtypes bf16,fp8 --sweep-seconds 1.5 --config default --config stages=3 ;;
    sustained_grouped_ab_deepseek) section sustained_grouped_ab_deepseek 300 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/gemm_clock.py --sustained-sweep --grouped --problem deepseek --dtypes bf16,fp8 --sweep-seconds 1.5 --config default --config wg_split=m,stages=3 ;;
    moe_layer) section moe_layer 420 bash -c "env CUDA_VISIBLE_DEVICES=0 $PY -m pallas_kernels.bench_grouped --layer-only --quick; env CUDA_VISIBLE_DEVICES=0 $PY -m pallas_kernels.bench_grouped --layer-only --quick --problem deepseek" ;;
    profile_moe) section profile_moe 360 bash -c "env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/profile_ffn.py --top 30 --moe mixtral --recipe fp8_rowwise --recipe bf16; env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/profile_ffn.py --top 30 --moe deepseek --recipe fp8_rowwise --recipe bf16" ;;
    ffn_vs_torch) section ffn_vs_torch 540 bash -c "env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false $PY -m pallas_kernels.bench fp8 --shapes none --quick; env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/torch_ffn_anchor.py; env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false $PY -m pallas_kernels.bench fp8 --shapes none --quick" ;;
    profile_ffn) section profile_ffn 300 env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" $PY benchmarks/profile_ffn.py --top 40 --recipe fp8_rowwise --recipe fp8_tensorwise --recipe bf16 ;;
    tests_quantize) section tests_quantize 200 $PY -m pytest -q -m gpu -x tests/test_quantize.py ;;
    cast_shapes) section cast_shapes 300 env CUDA_VISIBLE_DEVICES=0 $PY -m pallas_kernels.bench fp8 --shapes none --quick --cast-shapes 8192x4096,8192x6144,8192x14336,8192x28672,4096x4096,4096x6144,4096x28672,14336x4096 --cast-config amax_bm=128,amax_bn=128 --cast-config amax_bm=64,amax_bn=128 ;;
    grouped_vs_torch) section grouped_vs_torch 480 bash -c "env CUDA_VISIBLE_DEVICES=0 $PY -m pallas_kernels.bench_grouped --quick --no-ffn; env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/torch_grouped_anchor.py; env CUDA_VISIBLE_DEVICES=0 $PY -m pallas_kernels.bench_grouped --quick --no-ffn --dtypes bf16" ;;
    cast_sweep) section cast_sweep 200 env CUDA_VISIBLE_DEVICES=0 $PY -m pallas_kernels.bench fp8 --shapes none --quick --cast-config amax_bm=64,amax_bn=128,cast_bm=64,cast_bn=128 --cast-config amax_bm=64,amax_bn=256,cast_bm=64,cast_bn=128 --cast-config amax_bm=128,amax_bn=128,cast_bm=64,cast_bn=128 --cast-config amax_bm=64,amax_bn=256,cast_bm=64,cast_bn=256 --cast-config amax_bm=64,amax_bn=128,cast_bm=128,cast_bn=128 --cast-config amax_bm=64,amax_bn=256,cast_bm=128,cast_bn=128 ;;
    tests_recipes) section tests_recipes 150 $PY -m pytest -q -m gpu -x tests/test_quant_recipes.py tests/test_model.py ;;
    train_graphs) section train_graphs 420 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out "$LOGS" --steps 30 --base "$DENSE8B model.scan_layers=false quant.recipe=fp8_rowwise" --variant fp8: --variant fp8_no_cmd_buffer:@--xla_gpu_enable_command_buffer= --variant fp8_cmd_custom:@--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN ;;
    train_concurrent) section train_concurrent 540 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out "$LOGS" --steps 20 --base "$DENSE8B model.scan_layers=false" --variant bf16: --variant bf16_concurrent:@--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --variant fp8:quant.recipe=fp8_rowwise --variant fp8_concurrent:"quant.recipe=fp8_rowwise @--xla_gpu_command_buffer_scheduling_mode=CONCURRENT" ;;
    train_vs_torch) section train_vs_torch 600 bash -c "env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out $LOGS --steps 20 --base '$DENSE8B model.scan_layers=false' --variant bf16: --variant fp8_rowwise:quant.recipe=fp8_rowwise; env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/torch_llama_anchor.py --layers 8 --seq 8192 --steps 20 --variant autocast:gqa:auto autocast:repeat:flash autocast:repeat:cudnn autocast:gqa:cudnn fsdp2:repeat:cudnn; env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out $LOGS --steps 20 --base '$DENSE8B model.scan_layers=false' --variant bf16_again:" ;;
    profile_gemms) section profile_gemms 300 env XLA_FLAGS="--xla_gpu_enable_command_buffer=" $PY benchmarks/profile_step.py --steps 3 --top 60 --dump "$LOGS/prof_bf16" ${DENSE8B} model.scan_layers=false ;;
    train_blas) section train_blas 420 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out "$LOGS" --steps 20 --base "$DENSE8B model.scan_layers=false" --variant bf16: --variant bf16_cublaslt:@--xla_gpu_enable_cublaslt=true --variant bf16_blas1:@--xla_gpu_blas_max_algorithms=1 --variant bf16_again: ;;
    profile_unrolled) section profile_unrolled 240 $PY benchmarks/profile_step.py --steps 3 --top 30 ${DENSE8B} model.scan_layers=false ;;
    bench_grouped_quick) section bench_grouped_quick 240 $PY -m pallas_kernels.bench grouped --quick ;;
    grouped_deepseek) section grouped_deepseek 240 env CUDA_VISIBLE_DEVICES=0 $PY -m pallas_kernels.bench_grouped --problem deepseek --no-ffn ;;
    train_deepseek) section train_deepseek 240 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out "$LOGS" --steps 15 --log-every 5 --base "--config configs/deepseek_moe_16b.yaml model.n_layers=4 data.seq_len=4096 data.batch_size=2 mesh.fsdp=1 data.source=embedded" --variant deepseek4: ;;
    train_dense) section train_dense 480 $PY benchmarks/bench_train.py --out "$LOGS" --steps 20 --base "$DENSE8B" --variant bf16: ;;
    train_recipes) section train_recipes 420 $PY benchmarks/bench_train.py --out "$LOGS" --steps 15 --base "$DENSE8B" --variant bf16: --variant fp8_rowwise:quant.recipe=fp8_rowwise --variant mxfp8:quant.recipe=mxfp8 ;;
    profile_dense) section profile_dense 240 $PY benchmarks/profile_step.py --steps 3 --top 30 ${DENSE8B} ;;
    profile_fp8) section profile_fp8 240 $PY benchmarks/profile_step.py --steps 3 --top 30 ${DENSE8B} quant.recipe=fp8_rowwise ;;
    nccl_a2a) section nccl_a2a 120 torchrun --nproc_per_node="$(nvidia-smi -L | wc -l)" benchmarks/nccl_a2a_torch.py ;;
    dispatch) section dispatch 200 $PY benchmarks/bench_dispatch.py ;;
    row_exchange) section row_exchange 200 $PY benchmarks/bench_row_exchange.py ;;
    dispatch_decomposer) section dispatch_decomposer 200 env XLA_FLAGS="--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true" $PY benchmarks/bench_dispatch.py ;;
    moe_1gpu) section moe_1gpu 200 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/profile_step.py --steps 3 --top 15 $MOE data.batch_size=1 mesh.expert=1 ;;
    moe_ep_xla) section moe_ep_xla 200 $PY benchmarks/profile_step.py --steps 3 --top 15 $MOE data.batch_size="$(nvidia-smi -L | wc -l)" mesh.expert="$(nvidia-smi -L | wc -l)" model.moe.all_to_all=xla ;;
    moe_recipes) section moe_recipes 300 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --steps 20 --base "$MOE data.batch_size=1 mesh.expert=1" --variant bf16: --variant fp8_rowwise:quant.recipe=fp8_rowwise ;;
    profile_moe_ep) section profile_moe_ep 300 bash -c "for r in bf16 fp8_rowwise; do $PY benchmarks/profile_step.py --steps 3 --top 25 $MOE data.batch_size=$(nvidia-smi -L | wc -l) mesh.expert=$(nvidia-smi -L | wc -l) quant.recipe=\$r; done" ;;  # session 33: the fp8 step's copies at the update
    moe_ep_recipes) section moe_ep_recipes 300 $PY benchmarks/bench_train.py --steps 20 --base "$MOE data.batch_size=$(nvidia-smi -L | wc -l) mesh.expert=$(nvidia-smi -L | wc -l)" --variant bf16: --variant fp8_rowwise:quant.recipe=fp8_rowwise ;;
    memory_check) section memory_check 420 bash -c "$PY -m mx_jax.train --dry-run $LAYOUT8B quant.recipe=fp8_rowwise; $PY -m mx_jax.train --dry-run $MOE data.batch_size=1 mesh.expert=1; env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out $LOGS --steps 10 --base '$LAYOUT8B' --variant fp8_rowwise:quant.recipe=fp8_rowwise; env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_train.py --out $LOGS --steps 10 --base '$MOE data.batch_size=1 mesh.expert=1' --variant mixtral2_bf16:" ;;  # memory_estimate and XLA's GPU compile against the measured peaks
    moe_ep) section moe_ep 200 $PY benchmarks/profile_step.py --steps 3 --top 15 $MOE data.batch_size="$(nvidia-smi -L | wc -l)" mesh.expert="$(nvidia-smi -L | wc -l)" ;;
    train_profile) section train_profile 300 $PY -m mx_jax.train $DENSE8B steps=13 quant.recipe=fp8_rowwise log.profile_steps=3 log.profile_from=10 ckpt.every_steps=-1 log.eval_every_steps=-1 log.progress=false log.tensorboard=false run_dir=/tmp/mx_jax_profile_run ;;
    sigterm) section sigterm 420 bash benchmarks/sigterm_check.sh 20 $DENSE8B quant.recipe=fp8_rowwise ckpt.every_steps=0 log.eval_every_steps=-1 log.every_steps=5 log.progress=false log.tensorboard=false run_dir=/tmp/mx_jax_sigterm_run ;;
    sample) section sample 420 bash -c "$PY -m mx_jax.train --config configs/llama3_1b.yaml model.n_layers=2 data.source=embedded data.seq_len=2048 data.batch_size=4 quant.recipe=fp8_rowwise steps=2 log.progress=false log.tensorboard=false run_dir=/tmp/mx_jax_sample_1b | tail -2 && $PY -m mx_jax.sample /tmp/mx_jax_sample_1b --tokens 64 --num 2 --prompt 'def ' && $PY -m mx_jax.sample /tmp/mx_jax_sample_1b --tokens 64 --num 2 --prompt 'def ' quant.recipe=fp8_rowwise && $PY -m mx_jax.train $DENSE8B quant.recipe=fp8_rowwise steps=1 log.progress=false log.tensorboard=false run_dir=/tmp/mx_jax_sample_8b | tail -2 && $PY -m mx_jax.sample /tmp/mx_jax_sample_8b --tokens 32 && $PY -m mx_jax.sample /tmp/mx_jax_sample_8b --tokens 160" ;;
    loss_curves) section loss_curves 420 bash benchmarks/loss_curves.sh "$LOGS" ;;
    *) echo "unknown section $s" ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
[ -f "$LOGS/loss_curves.png" ] && cp "$LOGS/loss_curves.png" "$OUT/"
echo
cat "$LOGS/summary.txt"
for s in "$@"; do
  [ -f "$LOGS/$s.log" ] || continue
  echo "----- $s (tail)"
  tail -n 40 "$LOGS/$s.log"
done
