# Sourced from the repository root on the device machine by docs/gpu-kit/checks.sh: puts
# the model in /tmp/model (from /tmp/mpart.aa, left by the first call, and .dev/f/mpart.ab),
# the CUDA libraries on LD_LIBRARY_PATH, the repository at /work/main and the fixtures at
# /work/shared/fixtures (the test binary looks for ../shared/fixtures beside the path it
# was built in).
D=$PWD
unxz_to() { # unxz_to FILE.xz OUT
    if command -v xz >/dev/null; then xz -d -c "$1" > "$2"
    else python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$2"; fi
}
if [ ! -f /tmp/model/model.safetensors ]; then
    [ -f /tmp/mpart.aa ] && [ -f "$D/.dev/f/mpart.ab" ] || { echo "setup: the model parts are not both here (call 1 copies mpart.aa, call 2 carries .dev/f)"; return 1; }
    cat /tmp/mpart.aa "$D/.dev/f/mpart.ab" > /tmp/model.tar.xz
    echo "$(cat "$D/.dev/f/model.sha256")  /tmp/model.tar.xz" | sha256sum -c --quiet || { echo "setup: the model parts do not match"; return 1; }
    mkdir -p /tmp/model
    unxz_to /tmp/model.tar.xz /tmp/model.tar && tar xf /tmp/model.tar -C /tmp/model || return 1
    rm -f /tmp/model.tar /tmp/model.tar.xz
fi
export FLUMEN_MODEL_DIR=/tmp/model
libdirs=$(find /opt /usr/local /usr/lib /usr/lib64 \( -name 'libcublas.so.13*' -o -name 'libnvrtc.so.13*' \) 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
mkdir -p /work/shared/fixtures
[ -e /work/main ] || ln -s "$D" /work/main
cp "$D/.dev/s/minilm-reference.jsonl" /work/shared/fixtures/
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
true
