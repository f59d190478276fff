#!/usr/bin/env python3
"""Python tiktoken's o200k_base on a text file: the floor the retrieval
bench compares its Rust chunking with (run by
`cargo bench -p toolfleet-worker-retrieval --bench retrieval`).

Usage: bench_tiktoken.py TEXT_FILE ROUNDS
Prints one JSON line: {"tokens": N, "seconds": best-of-ROUNDS wall time}.
TIKTOKEN_CACHE_DIR must hold the o200k_base file (the bench writes it:
there is no network to fetch it from).
"""
import json
import sys
import time

import tiktoken


def main() -> None:
    path, rounds = sys.argv[1], int(sys.argv[2])
    with open(path, encoding="utf-8") as f:
        text = f.read()
    enc = tiktoken.get_encoding("o200k_base")
    best = float("inf")
    tokens = 0
    for _ in range(rounds):
        start = time.perf_counter()
        tokens = len(enc.encode_ordinary(text))
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"tokens": tokens, "seconds": best}))


if __name__ == "__main__":
    main()
