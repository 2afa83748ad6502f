"""llama.cpp's `llama-server` as a peer: the same workload at several slot counts.

Each run starts the server with `-np slots` parallel slots (continuous batching, prompt
cache on), sends every request at t=0 as token ids to /completion with ignore_eos and
the request's own n_predict, and times the whole workload. The best slot count is the
peer's figure.

Build the server from the llama.cpp copy inside PyPI's llama-cpp-python sdist (README,
"Engine speed"); nothing here downloads anything.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm
from workload import Workload


@dataclass
class PeerRun:
    slots: int
    wall_s: float
    output_tokens: int
    prompt_tokens: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def computed_tok_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.wall_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, object], timeout: float = 900) -> dict[str, object]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


def run_slots(binary: Path, model: Path, wl: Workload, slots: int, threads: int) -> PeerRun:
    """One server, one pass of the workload; the server is stopped before returning."""
    port = _free_port()
    cmd = [str(binary), "-m", str(model), "-c", str(slots * 2048), "-np", str(slots)]
    cmd += ["-t", str(threads), "-cb", "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"llama-server did not start: {' '.join(cmd)}")
            time.sleep(0.5)
        # Warm-up: one short request.
        _post(base + "/completion", {"prompt": wl.prompts[0][:8], "n_predict": 2})

        def one(i: int) -> int:
            body = {
                "prompt": wl.prompts[i],
                "n_predict": wl.output_lens[i],
                "ignore_eos": True,
                "temperature": 0.0,
                "cache_prompt": True,
            }
            return int(_post(base + "/completion", body)["tokens_predicted"])  # type: ignore[call-overload]

        t0 = time.time()
        produced = 0
        with (
            ThreadPoolExecutor(len(wl.prompts)) as pool,
            tqdm(
                total=wl.output_tokens, desc=f"llama-server {slots} slots", file=sys.stderr
            ) as bar,
        ):
            for k in pool.map(one, range(len(wl.prompts))):
                produced += k
                bar.update(k)
        return PeerRun(slots, time.time() - t0, produced, wl.prompt_tokens)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_peer(
    binary: Path, model: Path, wl: Workload, slot_counts: tuple[int, ...], threads: int
) -> list[PeerRun]:
    return [run_slots(binary, model, wl, s, threads) for s in slot_counts]
