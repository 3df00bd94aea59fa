#!/usr/bin/env bash
# The H200 runs, in stages that each fit a 10-minute slot, results to one folder.
#
#   bash benchmarks/run_gpu.sh STAGE [OUT]
#   STAGE: tests [PATH...] (the GPU tests of PATHs, default all of tests/, in $WORKERS pytest-xdist
#   processes, default one per 32 GiB of GPU memory, at most 4: the largest tests hold 22-26 GiB each;
#   the failures' names in the log's last lines) | ep | epscale | parscale (every GPU, torchrun: moe_fp8.bench.ep_scaling / parallel_step; run
#   parscale on one GPU too, then `python -m moe_fp8.bench.parallel_step --weak-scaling --out DIR` over the
#   reports gathered in DIR tabulates weak scaling) | parallel | harness | demo | weightquant | layerpeak (benchmarks/bench_layer_peak.py) | gradacc (the GPU tests of
#   tests/test_grad_accumulation.py, benchmarks/bench_grad_accumulation.py) | models | dsv3 | qwen3 | llama4 (the last four:
#   python -m moe_fp8.bench presets) | whole MODEL... (the whole-model step of the named models against HF
#   BF16 and TorchAO, eager and compiled: bench_whole_<first model>.json/.md) | job ACCUMULATE MODEL...
#   (the whole-model step with $LAYERS decoder layers, default 4, and ACCUMULATE micro-batches per optimizer step;
#   modes from $MODES, default "eager compiled"; variants from $VARIANTS, default hf_bf16 ours_fp8
#   ours_fp8_experts torchao_rowwise; eager loss steps from $STEPS, default 40; time limit $LIMIT,
#   default 590 s; PROFILE=1: each row also profiles one more step, device time by kernel category
#   and the allocations alive at its peak; ROUTING=balanced: the MoE routers score random inputs: bench_job_acc<ACCUMULATE>_<first model><$SUFFIX>.json/.md) | ab OUT BASE ARGS... (the
#   `python -m moe_fp8.bench ARGS...` run twice, on the tree in the folder BASE (another commit, e.g.
#   `git worktree add build/base COMMIT`, carried to the device) and on this one, named ARGS' --name
#   with the suffixes _base and _head)
#
# OUT defaults to benchmarks/results. A TorchAO wheel in .whl/ (see BENCHMARKS.md) is installed
# into a temporary folder first, for the side-by-side columns. Each stage is time-limited so that
# a hang ends the stage instead of the run.
set -uo pipefail
stage=${1:?usage: run_gpu.sh tests|ep|epscale|parscale|parallel|harness|demo|weightquant|layerpeak|gradacc|models|dsv3|qwen3|llama4|whole|job|ab [OUT] [ARGS...]}
out=${2:-benchmarks/results}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out" && out=$(cd "$out" && pwd)
site=
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/torchao-*.whl" > /dev/null; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --target "$site" .whl/torchao-*.whl && export PYTHONPATH="$site:$PYTHONPATH"
fi

run() {  # run LIMIT_SECONDS LOG command...
  local limit=$1 log=$2
  shift 2
  echo "== $* (limit ${limit}s, log $out/$log)"
  timeout "$limit" "$@" > "$out/$log" 2>&1
  local rc=$?
  tail -n 25 "$out/$log" | grep -v -i warn
  echo "== rc=$rc"
}

case $stage in
  tests)   workers=${WORKERS:-$(python3 -c "import torch; print(max(1, min(4, torch.cuda.get_device_properties(0).total_memory // 2**35)))")}
           run 570 gpu_tests.log python3 -m pytest -q -m gpu -n "$workers" -rfE -p no:cacheprovider \
             --durations=10 "${@:-tests}" ;;
  ep)      run 300 expert_parallel_tests.log python3 -m pytest -q -m gpu tests/test_expert_parallel_gpu.py \
             tests/test_multi_gpu.py -p no:cacheprovider
           run 300 expert_parallel.log python3 -m moe_fp8.bench.expert_parallel --out "$out" ;;
  harness) run 300 harness.log python3 -m moe_fp8.testing --device cuda --jobs 6 --timeout 90 \
             --impl torch --impl torch_scaled --impl torchao --impl moe_fp8:cuda_auto --impl moe_fp8:cuda \
             --impl moe_fp8:hybrid --impl moe_fp8:triton --impl moe_fp8:cuda_auto:rowwise_gw_hp \
             --impl moe_fp8:cuda_auto:tensorwise --impl moe_fp8:cuda_auto:blockwise --impl moe_fp8:cuda_auto:bf16 \
             --json "$out/harness_gpu.json" --markdown "$out/harness_gpu.md" ;;
  epscale) gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
           for model in dsv3 qwen3; do
             run 290 "ep_scaling_${model}_w$gpus.log" torchrun --standalone --nproc-per-node "$gpus" \
               -m moe_fp8.bench.ep_scaling --model "$model" --out "$out"
           done ;;
  parscale) gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
           run 590 "parallel_step_dsv3_w$gpus.log" torchrun --standalone --nproc-per-node "$gpus" \
             -m moe_fp8.bench.parallel_step --model dsv3 --layers 4 --recipes fp8 bf16 --variants fsdp --out "$out" ;;
  parallel) run 300 gpu_tests_parallelize.log python3 -m pytest -q -s -m gpu tests/test_parallelize_gpu.py -p no:cacheprovider
           run 300 parallel_step.log python3 -m moe_fp8.bench.parallel_step --out "$out" ;;
  demo)    run 420 demo.log python3 -m moe_fp8.demo --plot "$out/demo_loss.png" ;;
  layerpeak) run 300 layer_peak.log python3 benchmarks/bench_layer_peak.py --out "$out" ;;
  gradacc) run 150 grad_accumulation_tests.log python3 -m pytest -q -m gpu tests/test_grad_accumulation.py -p no:cacheprovider
           run 120 grad_accumulation.log python3 benchmarks/bench_grad_accumulation.py --out "$out" ;;
  weightquant) run 300 weight_quant_tests.log python3 -m pytest -q -m gpu tests/test_adamw_quantize_gpu.py \
             -p no:cacheprovider
           run 180 weight_quant_step.log python3 benchmarks/bench_weight_quant_step.py --out "$out" ;;
  whole)   run 580 "bench_whole_$1.log" python3 -m moe_fp8.bench --preset models --kinds model --models "$@" \
             --modes eager compiled --steps 40 --name "bench_whole_$1" --out "$out" \
             --variants hf_bf16 ours_fp8 torchao_rowwise torchao_rowwise_gw_hp torchao_moe ;;
  job)     acc=$1
           shift
           read -r -a modes <<< "${MODES:-eager compiled}"
           read -r -a variants <<< "${VARIANTS:-hf_bf16 ours_fp8 ours_fp8_experts torchao_rowwise}"
           run "${LIMIT:-590}" "bench_job_acc${acc}_$1${SUFFIX:-}.log" python3 -m moe_fp8.bench --preset models --kinds model \
             --models "$@" --layers "${LAYERS:-4}" --accumulate "$acc" --modes "${modes[@]}" --steps "${STEPS:-40}" \
             --name "bench_job_acc${acc}_$1${SUFFIX:-}" --out "$out" --variants "${variants[@]}" \
             ${PROFILE:+--profile} ${ROUTING:+--routing "$ROUTING"} ;;
  ab)      [[ -d ${1:-}/moe_fp8 ]] || { echo "ab: BASE '${1:-}' holds no moe_fp8 tree (run_gpu.sh ab OUT BASE ARGS...)" >&2; exit 2; }
           base=$(cd "$1" && pwd) || exit 2
           shift
           args=("$@") name=ab
           for ((i = 0; i + 1 < ${#args[@]}; i++)); do [[ ${args[i]} == --name ]] && name=${args[i + 1]}; done
           for side in base head; do
             root=$PWD
             [[ $side == base ]] && root=$base
             (cd "$root" && PYTHONPATH="$root${site:+:$site}" run "${LIMIT:-280}" "${name}_$side.log" \
               python3 -m moe_fp8.bench "$@" --name "${name}_$side" --out "$out")
           done ;;
  dsv3|qwen3|llama4|models) run 540 "bench_$stage.log" python3 -m moe_fp8.bench --preset "$stage" --out "$out" ;;
  *)       echo "unknown stage: $stage" >&2; exit 2 ;;
esac
