"""Baseline for benches/embed.rs: sentence-transformers embedding the same sentences.

Usage: python embed_baseline.py SENTENCES_FILE MODEL_DIR DEVICE THREADS [BATCH_SIZE [PRECISION]]

PRECISION is fp32 (the default) or half (`model.half()`: fp16 weights and activations).

SENTENCES_FILE holds one JSON string per line. Prints one line:
    baseline device=cpu precision=P sentences=N seconds=S per_s=R
Needs sentence-transformers (install it in a venv; CI does not run this).
"""

import json
import sys
import time

import torch
from sentence_transformers import SentenceTransformer


def main() -> None:
    path, model_dir, device, threads = sys.argv[1:5]
    batch_size = int(sys.argv[5]) if len(sys.argv) > 5 else 32
    precision = sys.argv[6] if len(sys.argv) > 6 else "fp32"
    torch.set_num_threads(int(threads))
    with open(path, encoding="utf-8") as f:
        sentences = [json.loads(line) for line in f]
    model = SentenceTransformer(model_dir, device=device)
    model.max_seq_length = 256
    if precision == "half":
        model.half()
    # Warm up (first call initialises kernels), as the flumen side loads its model first too.
    model.encode(sentences[:64], batch_size=batch_size, normalize_embeddings=True)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.encode(sentences, batch_size=batch_size, normalize_embeddings=True)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(
        f"baseline device={device} precision={precision} sentences={len(sentences)} "
        f"seconds={seconds:.3f} per_s={len(sentences) / seconds:.1f}"
    )


if __name__ == "__main__":
    main()
