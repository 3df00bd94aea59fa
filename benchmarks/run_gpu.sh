#!/usr/bin/env bash
# GPU tests and benchmarks in stages that each fit a 10-minute slot, results to one folder.
#
#   bash benchmarks/run_gpu.sh STAGE [OUT]
#   STAGE: tests | quant | quant-sweep | quant-lag | gemm | gemm-ab | layer | layer-sizes | layer-ab | routing | profile |
#          ep | harness | all
#
# OUT defaults to benchmarks/results. A TorchAO wheel in .whl/ (see BENCHMARKS.md) is installed
# into a temporary folder first, for the side-by-side columns. Each stage is time-limited so that
# a hang (e.g. a kernel that never returns) ends the stage instead of the session.
set -uo pipefail
stage=${1:?usage: run_gpu.sh tests|quant|quant-sweep|quant-lag|gemm|gemm-ab|layer|layer-sizes|layer-ab|routing|profile|ep|harness|all [OUT]}
out=${2:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
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
  tests)   run 570 gpu_tests.log python3 -m pytest -q -m gpu tests -p no:cacheprovider --durations=10 ;;
  quant)   run 420 quant.log python3 benchmarks/bench_quant.py --out "$out" ;;
  quant-sweep) run 540 quant_sweep.log python3 benchmarks/bench_quant.py --sweep --budget-s 400 --out "$out/sweep" ;;
  quant-lag) run 300 colwise_lag.log python3 benchmarks/sweep_colwise_lag.py --out "$out" ;;
  gemm)    run 540 grouped_gemm.log python3 benchmarks/bench_grouped_gemm.py --out "$out" ;;
  gemm-ab) run 540 grouped_gemm_ab.log python3 benchmarks/bench_grouped_gemm.py --rounds 5 --methods \
             "TorchAO fp8 rowwise" "rowwise / cuda" "rowwise / cuda_auto" "rowwise / hybrid" "rowwise / triton" \
             --out "$out/gemm_ab" ;;
  layer)   run 420 moe_layer.log python3 benchmarks/bench_moe_layer.py --out "$out" ;;
  layer-sizes) run 540 moe_layer_sizes.log python3 benchmarks/bench_moe_layer.py --tokens 4096 16384 \
                 --layers deepseek_v3_e8 deepseek_v3_e32 qwen3_30b_a3b --out "$out/sizes" ;;
  layer-ab) run 300 ab_layer_backends.log python3 benchmarks/ab_layer_backends.py --out "$out" ;;
  routing) run 300 routing.log python3 benchmarks/bench_routing.py --out "$out" ;;
  profile) run 300 profile.log python3 benchmarks/profile_layers.py --out "$out" ;;
  ep)      run 300 expert_parallel_tests.log python3 -m pytest -q -m gpu tests/test_expert_parallel_gpu.py -p no:cacheprovider
           run 300 expert_parallel.log python3 benchmarks/bench_expert_parallel.py --out "$out" ;;
  harness) run 300 harness.log python3 -m moe_fp8.testing --device cuda --jobs 6 --timeout 90 \
             --impl torch --impl torch_scaled --impl torchao --impl moe_fp8:cuda_auto --impl moe_fp8:cuda \
             --impl moe_fp8:hybrid --impl moe_fp8:triton --impl moe_fp8:cuda_auto:rowwise_gw_hp \
             --impl moe_fp8:cuda_auto:tensorwise --impl moe_fp8:cuda_auto:blockwise --impl moe_fp8:cuda_auto:bf16 \
             --json "$out/harness_gpu.json" --markdown "$out/harness_gpu.md" ;;
  all)     for s in tests quant gemm layer routing; do bash "$0" "$s" "$out"; done ;;
  *)       echo "unknown stage: $stage" >&2; exit 2 ;;
esac
