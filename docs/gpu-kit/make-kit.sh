#!/usr/bin/env bash
# Build the kit a lent GPU machine runs flumen's CUDA checks from (docs/gpu-checks.md):
# the model in two parts, the test and bench binaries stripped and xz-compressed, and the
# device-side scripts, under .dev/ (ignored by git), one folder per `run` call's carry.
#
#   bash docs/gpu-kit/make-kit.sh            # bench binaries in the bench profile (release)
#   bash docs/gpu-kit/make-kit.sh --debug    # bench binaries from the dev profile: a quick
#                                            # dry run of the kit (figures not to be kept)
#
# The device machine has CUDA, PyTorch and sentence-transformers but no Rust toolchain and
# no network; each call carries at most 64 MiB (tree included), so every folder below is
# checked against that. Run it from the repository root after the code is final: the
# binaries are those of the working tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
profile=bench
[ "${1:-}" = "--debug" ] && profile=debug
model_dir="${FLUMEN_MODEL_DIR:-$HOME/.cache/flumen/models/all-MiniLM-L6-v2}"
fixtures="../shared/fixtures/minilm-reference.jsonl"
[ -f "$model_dir/model.safetensors" ] || { echo "no model at $model_dir: run flumen install-model first"; exit 1; }
[ -f "$fixtures" ] || { echo "no $fixtures beside the repository"; exit 1; }
export LD_LIBRARY_PATH="$PWD/target/cuda-nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

mkdir -p .git/info && touch .git/info/exclude
grep -qx '/.dev/' .git/info/exclude || echo '/.dev/' >> .git/info/exclude
rm -rf .dev && mkdir -p .dev/m1 .dev/f .dev/e .dev/q .dev/p .dev/s

# The executable a cargo build made for `target` (`--test embedding`, `--bench embed`).
executable() {
    "$@" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
paths = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m.get("executable")]
print(paths[-1])'
}

# Strip binary $1 and compress it to $2.
pack() {
    strip -o /tmp/kit-binary "$1"
    xz -9e -T2 -c /tmp/kit-binary > "$2"
    rm -f /tmp/kit-binary
    echo "packed $(basename "$2"): $(du -h "$2" | cut -f1)"
}

echo "model: $model_dir"
tar cf - -C "$model_dir" . | xz -9e -T2 > /tmp/kit-model.tar.xz
sha256sum /tmp/kit-model.tar.xz | cut -d' ' -f1 > .dev/f/model.sha256
split -b 60000000 /tmp/kit-model.tar.xz /tmp/kit-mpart.
mv /tmp/kit-mpart.aa .dev/m1/mpart.aa
mv /tmp/kit-mpart.ab .dev/f/mpart.ab
rm -f /tmp/kit-model.tar.xz

pack "$(executable cargo test --test embedding)" .dev/e/embedding.xz
if [ "$profile" = bench ]; then
    pack "$(executable cargo bench --bench embed)" .dev/q/embed.xz
    pack "$(executable cargo bench --bench pipeline)" .dev/p/pipeline.xz
else
    pack "$(executable cargo test --bench embed)" .dev/q/embed.xz
    pack "$(executable cargo test --bench pipeline)" .dev/p/pipeline.xz
fi
cp docs/gpu-kit/setup.sh docs/gpu-kit/checks.sh "$fixtures" .dev/s/

# Every call carries the tree (tracked and untracked files git does not ignore) and its
# folders; each must stay under 64 MiB.
tree_bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
check_call() {
    local bytes=$tree_bytes dir
    for dir in "$@"; do bytes=$((bytes + $(du -sb ".dev/$dir" | cut -f1))); done
    local verdict=ok
    [ "$bytes" -lt $((64 * 1024 * 1024)) ] || verdict="OVER 64 MiB"
    printf '  carry %-28s %6.1f MiB  %s\n' "[$(printf '.dev/%s ' "$@" | sed 's/ $//')]" "$(echo "$bytes / 1048576" | bc -l)" "$verdict"
    [ "$verdict" = ok ]
}
echo "the calls (docs/gpu-checks.md, \"Issue 69's checks\"), back to back:"
check_call m1 s
check_call f e s
check_call q s
check_call p s
echo "kit ready in .dev/ ($profile profile)"
