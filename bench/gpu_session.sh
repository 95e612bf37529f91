#!/usr/bin/env bash
# The GPU measurements of issue 14, one phase per call of under ten minutes, on one H200.
#
#   bash bench/gpu_session.sh encoder   # GPU tests (encoder, views, decoder), graph_bench, the page and views probes
#   bash bench/gpu_session.sh kernels   # encoder kernel tiles tuned and written, GELU epilogue, graph_bench, GPU tests
#   bash bench/gpu_session.sh decoder   # decoder GPU tests, decoder_bench (prefill kernels against their
#                                       # twins) and profile, both experts kernels
#   bash bench/gpu_session.sh tune-moe  # the fused MoE kernels' tiles, decode and prefill (bench/tune_moe_kernel.py)
#   bash bench/gpu_session.sh compile   # compile_bench --all_budgets twice (cold, warm cache), compile test
#   bash bench/gpu_session.sh serve     # GPU tests that need Ray, the decode and hop probes, serve_bench with py-spy samples
#                                       # (default, one_encoder, encoder_in_router; needs the Ray bundle)
#   bash bench/gpu_session.sh e2e       # e2e_bench (needs the Ray bundle)
#   bash bench/gpu_session.sh e2e-one-encoder   # e2e_bench of gpu-shared-one-encoder.yaml
#   bash bench/gpu_session.sh e2e-encoder-in-router   # e2e_bench of gpu-shared-encoder-in-router.yaml
#   bash bench/gpu_session.sh startup   # e2e_bench's cold start and one page alone, three ways (~5 min)
#
# Results go to $OUT (the device tool brings them back) or bench/results. The Ray bundle and
# wheels travel as .devpkgs/ray-site.tar.xz and .whl/ (../shared/device/build-ray-bundle).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1

ray_bundle() {
  mkdir -p /tmp/site
  tar -xJf .devpkgs/ray-site.tar.xz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  # Bytecode, as a pip install writes it: otherwise every process of the first `serve run`
  # compiles Ray's 3,000 modules as it imports them (seconds of a cold start a user never sees).
  python3 -m compileall -q -j 0 /tmp/site deployments encoder decoder scheduler common documents corpus >/dev/null || true
  export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
}

case "${1:?phase: encoder, kernels, decoder, tune-moe, compile, serve, e2e, e2e-one-encoder, e2e-encoder-in-router or startup}" in
  encoder)
    if [ -f .devpkgs/ray-site.tar.xz ] && [ -d .whl ]; then ray_bundle; fi  # the deployment test needs Ray
    python3 -m pytest -q -rs -m gpu tests/test_checkpoint.py tests/test_resize.py tests/test_graphs.py tests/test_attention.py \
      tests/test_model.py tests/test_engine.py tests/test_decoder_model.py tests/test_sampling.py 2>&1 \
      | tee "$out/gpu-tests.txt" | tail -5 || echo "GPU TESTS FAILED (see gpu-tests.txt)"
    python3 bench/graph_bench.py --out "$out" 2>&1 | tail -30
    python3 bench/page_b1_probe.py --out "$out" 2>&1 | grep -v " stream " | tail -30  # one page, where the time goes
    python3 bench/staging_probe.py --out "$out" 2>&1 | grep "^copy\|^launch"  # host views' copies and launches
    python3 bench/views_probe.py 2>&1 | grep "ms GPU\|identical"  # the views' GPU time, resize kernel vs torch's ops
    ;;
  kernels)  # the encoder's kernel choices measured, the tuned tiles written, then graph_bench and GPU tests
    python3 bench/mlp_epilogue_bench.py --out "$out" 2>&1 | tail -5
    timeout 240 python3 bench/tune_relpos_kernel.py --jobs 16 --write_tuned 1 --out "$out" 2>&1 \
      | grep "best\|width\|TUNED\|compiled\|Error" || echo "TUNING FAILED"
    cp encoder/triton_relpos.py "$out/triton_relpos.py"  # with the TUNED table just written
    timeout 240 python3 bench/graph_bench.py --out "$out" 2>&1 | tail -14 || echo "GRAPH BENCH FAILED"
    timeout 150 python3 -m pytest -q -rs -m gpu tests/test_attention.py tests/test_model.py tests/test_graphs.py 2>&1 \
      | tee "$out/gpu-tests-kernels.txt" | tail -4 || echo "GPU TESTS FAILED"
    ;;
  decoder)  # the decoder's GPU tests, then the bench and profile with each experts kernel, and a prefill
    python3 -m pytest -q -rs -s -m gpu tests/test_decoder_model.py tests/test_engine.py 2>&1 \
      | tee "$out/gpu-tests-decoder.txt" | grep "moe kernels\|fused vs\|passed\|failed" || echo "DECODER GPU TESTS FAILED"
    python3 bench/decoder_bench.py --variants decode_graphs decode_graphs_prefill_grouped_mm decode_graphs_torch_rope \
      --out "$out" 2>&1 | grep " c[0-9]*:"
    python3 bench/profile_decoder.py --batch 64 256 --context 1280 --moe_kernel auto grouped_mm --prefill 16 \
      > "$out/profile-decoder.txt" 2>&1; grep "===" "$out/profile-decoder.txt"
    ;;
  tune-moe)
    python3 bench/tune_moe_kernel.py --out "$out" 2>&1 | grep -v "^ \|^{\|^}"
    python3 bench/tune_moe_kernel.py --prefill 1 --out "$out" 2>&1 | grep -v "^ \|^{\|^}"
    ;;
  compile)
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
    mkdir -p "$out/cold" "$out/warm"
    python3 bench/compile_bench.py --all_budgets 1 --out "$out/cold" 2>&1 | tail -8
    python3 bench/compile_bench.py --all_budgets 1 --out "$out/warm" 2>&1 | tail -8
    python3 -m pytest -q -s -m gpu tests/test_graphs.py -k compiled 2>&1 | tee "$out/gpu-tests-compile.txt" \
      | grep "relative error\|passed\|failed" || echo "COMPILE TEST FAILED"
    ;;
  serve)  # the GPU tests that need Ray, then serve_bench with py-spy samples of the first variant
    ray_bundle
    timeout 150 python3 -m pytest -q -rs --tb=short -m gpu tests/test_graphs.py -k "not compiled" 2>&1 \
      | tee "$out/gpu-tests-serve.txt" | tail -4 || echo "GPU TESTS FAILED"
    python3 bench/decode_probe.py 2>&1 | grep "process\|actor"  # the page's decode, in process and in an actor
    python3 bench/serve_hop_probe.py --out "$out" 2>&1 | grep " ms$"  # bare Serve calls, no app code
    python3 bench/serve_bench.py --variants shared shared-one-encoder shared-encoder-in-router \
      --py_spy "$out" --out "$out" 2>&1 \
      | grep -v " INFO \| WARNING " | tail -40
    ;;
  e2e)
    ray_bundle
    python3 bench/e2e_bench.py --out "$out" 2>&1 | tail -40
    ;;
  e2e-one-encoder|e2e-encoder-in-router)  # the same with both encoder paths in one process
    ray_bundle
    python3 bench/e2e_bench.py --config "gpu-shared-${1#e2e-}.yaml" --name "$1" --out "$out" 2>&1 | tail -40
    ;;
  startup)
    # Cold start three ways, one shared checkpoint: without and with Ray's workers preloading
    # the app's modules, each with an empty Triton kernel cache (a fresh node), then preloading
    # with the Triton cache the previous run left (a node that has served before).
    ray_bundle
    export TRITON_CACHE_DIR="$(mktemp -d)"  # the warm run reuses what the runs before left
    for run in nopreload preload preload-warm-triton; do
      flag="--warm_triton_cache"; [ "$run" = preload-warm-triton ] || rm -rf "$TRITON_CACHE_DIR"/*
      [ "$run" = nopreload ] && flag="$flag --no_preload"
      python3 bench/e2e_bench.py --levels 1 --name "e2e-startup-$run" --checkpoint /tmp/e2e-ckpt $flag \
        --out "$out" 2>&1 | grep "cold start\|c1:\|checkpoint\|Error" | tail -5 || echo "$run FAILED"
    done
    ;;
  *)
    echo "unknown phase $1" >&2
    exit 2
    ;;
esac
