#!/usr/bin/env bash
# The device side of flumen's CUDA checks (docs/gpu-checks.md, "Issue 69's checks"): one
# step per `run` call, from the repository root of the call's copy, with the folders of
# .dev/ that docs/gpu-kit/make-kit.sh made carried as it says. Each program runs under a
# timeout that keeps the call under the device's 600 s per command, and its output goes
# to the terminal and to $OUT (or /tmp/kit-out), so it comes back even when cut short.
#
#   bash .dev/s/checks.sh model      # carry [.dev/m1, .dev/s]: the model's first part to /tmp
#   bash .dev/s/checks.sh test       # carry [.dev/f, .dev/e, .dev/s]: the embedding tests (step 1)
#   bash .dev/s/checks.sh embed      # carry [.dev/q, .dev/s]: the embed bench (steps 2, 2b, 3)
#   bash .dev/s/checks.sh pipeline   # carry [.dev/p, .dev/s]: the pipeline bench in bf16 (step 4)
set -uo pipefail
step="${1:?which step: model, test, embed or pipeline}"
out="${OUT:-/tmp/kit-out}"
mkdir -p "$out"

# run NAME SECONDS COMMAND...: the command under a timeout, its output kept as $out/NAME.log.
run() {
    local name=$1 seconds=$2
    shift 2
    echo "=== $name: $* (at most ${seconds}s)"
    local started=$SECONDS
    timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - started))s"
}

if [ "$step" = model ]; then
    cp .dev/m1/mpart.aa /tmp/ && echo "model part 1 in /tmp ($(du -h /tmp/mpart.aa | cut -f1))"
    exit
fi
# shellcheck source=setup.sh
. .dev/s/setup.sh || exit 1
case "$step" in
test)
    unxz_to .dev/e/embedding.xz /tmp/embedding && chmod +x /tmp/embedding
    cd /work/main && run embedding-tests 300 /tmp/embedding --nocapture
    ;;
embed)
    unxz_to .dev/q/embed.xz /tmp/embed && chmod +x /tmp/embed
    cd /work/main
    # Step 2: the figures (bf16 summary line, its ratio against model.half(), roofline).
    run embed-precision 220 /tmp/embed --device cuda --python python3 --precision both --peak-tflops 989
    # Step 2b: two passes in flight against one.
    run embed-passes 150 /tmp/embed --device cuda --python python3 --precision bf16 --passes-in-flight both
    # Step 3: one GPU, two accelerator workers against one.
    for slots in 2 1; do
        run "embed-slots-$slots" 100 /tmp/embed --device cuda --python python3 --precision bf16 --corpus docs --accelerator-slots "$slots"
    done
    ;;
pipeline)
    unxz_to .dev/p/pipeline.xz /tmp/pipeline && chmod +x /tmp/pipeline
    cd /work/main
    # Step 4: the pipeline bench in bf16, first row and % of bound.
    run pipeline-bf16 400 /tmp/pipeline --accelerator cuda --pipelines two --rows 100000 --runs 3 \
        --skip-sweep --skip-memory --modes static,streaming --warm --precision bf16
    ;;
*)
    echo "no step '$step': model, test, embed or pipeline"
    exit 2
    ;;
esac
