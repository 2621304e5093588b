"""Sandbox start-up cost and a trivial rollout loop.

Part 1, latency (p50/p99 over --reps, after warm-up), all in one process and run:
- baseline `subprocess`: a bare `subprocess.run(["true"])` (spawn + wait), the cheapest possible
  "sandbox"; and the `local` backend (temp dirs + a process-group-managed `true`).
- baseline `today's backend launch`: what one start of the bwrap backend cost before its rewrite to a
  minimal root (up to 2026-12-02), as a plain command, so that the rewrite is compared with it in the
  same run although that code is gone: two fresh directories made (mkdtemp), `bwrap --ro-bind / /
  --dev /dev --proc /proc --tmpfs /tmp --tmpfs /run --bind WS /run/ws --bind HOME /run/home
  --unshare-all --die-with-parent --new-session --cap-drop ALL --hostname sandbox --chdir /run/ws --
  /bin/sh -c true`, both removed (rmtree). No cgroup, start script or status pipe: a lower bound of
  that backend's create+destroy.
- `bwrap create+destroy`: `BwrapBackend.create()` then `close()`, i.e. whatever the backend does to
  make a sandbox (currently: the sandbox directory with its disk-quota tmpfs when run as root, the cgroup,
  the hand-over of the workspace to the sandbox user, one real bwrap start running `true` as the start
  probe) and to destroy it; with and without a cgroup, with and without an allowed port (a host
  forwarder socket and socat inside), and without the start probe.
- `bwrap run`: one more `true` in an already created sandbox (the per-command cost).
- `bwrap create+destroy workdir=...`: the same with the workspace placed at an absolute path, as
  ClawGym tasks ask. The label says what the backend does for it, read from the sandbox: `rebuilt A`
  when it rebuilds the workdir's deepest existing ancestor A on a tmpfs (one bind per entry of A:
  currently only for a workdir inside a read-only system directory, e.g. /usr/src/app), `no rebuild` when
  the mount point is made directly (currently: anywhere else, e.g. under /root, which the sandbox does not
  see at all, or a new top-level directory).

Part 2, throughput: rollouts per minute at concurrency 1, 8, 32. A *trivial loop over the pool*, not
the rollout scheduler: each rollout creates a sandbox with a task file, runs `sh -c 'cat task.txt >
answer.txt'`, reads answer.txt back and destroys the sandbox. The load average is recorded because the
machine is shared.

- `pool(warm=2)`: the same create+destroy as a rollout sees it through a SandboxPool that keeps two
  sandboxes started ahead (files are written into a warm one on acquire).

Every latency row has two ratios of its p50: to the `subprocess` baseline and to today's backend
launch, each timed in the same run (the interleaved rows against the interleaved baselines, the warm
pool against the baselines timed alternately with it). The bar for the minimal-root backend is
create+destroy p50 <= 20 ms; the output checks each bwrap create+destroy row against it.

    python bench/bench_sandbox.py [--reps 200] [--rollouts 64]
Writes bench/results/bench_sandbox.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from clawfast.sandbox import SandboxPool, SandboxSpec
from clawfast.sandbox.bwrap import BwrapBackend
from clawfast.sandbox.local import LocalBackend


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def interleaved(variants: dict, reps: int, warmup: int = 5) -> dict[str, list[float]]:
    """Time each variant `reps` times, round-robin, so that the load of this shared machine (which
    swings by several x within seconds) weighs on all of them alike."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return out


BASELINE = "subprocess.run(['true'])  [baseline]"
TODAY = "today's backend launch (bwrap --ro-bind / /) [baseline]"
ALTERNATING = " (alternating with the warm pool)"
BAR_MS = 20.0


def todays_launch(bwrap: str, parent: str) -> None:
    """One start of the bwrap backend as it was before the minimal-root rewrite, as a plain command
    (see the module docstring): two fresh directories, one bwrap running `true`, both removed."""
    ws = tempfile.mkdtemp(prefix="ws-", dir=parent)
    home = tempfile.mkdtemp(prefix="home-", dir=parent)
    try:
        subprocess.run(
            [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
             "--tmpfs", "/run", "--bind", ws, "/run/ws", "--bind", home, "/run/home", "--unshare-all",
             "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox",
             "--chdir", "/run/ws", "--", "/bin/sh", "-c", "true"],
            check=True, stdin=subprocess.DEVNULL,
        )
    finally:
        shutil.rmtree(ws)
        shutil.rmtree(home)


def rebuilt(backend: BwrapBackend, workdir: str) -> str:
    """What the backend does to mount a workspace at `workdir`, as the sandbox records it."""
    sb = backend.create(SandboxSpec(workdir=workdir))
    try:
        room = getattr(sb, "_room", "?")
    finally:
        sb.close()
    return "no rebuild" if room is None else f"rebuilt {room}"


def latency(reps: int) -> list[dict]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    local = LocalBackend(allow_unsafe=True)
    plain = BwrapBackend(use_cgroup=False)
    cgrouped = BwrapBackend(use_cgroup=True)
    unprobed = BwrapBackend(use_cgroup=True, probe=False)
    in_shm = BwrapBackend(use_cgroup=True, base_dir="/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    warm = {name: b.create(SandboxSpec()) for name, b in (("off", plain), ("on", cgrouped))}
    today_dir = tempfile.mkdtemp(prefix=f"clawfast-bench-today-{os.getpid()}-")
    bwrap = shutil.which("bwrap")

    def local_cycle():
        sb = local.create(SandboxSpec())
        sb.run(["true"])
        sb.close()

    variants = {
        BASELINE: lambda: subprocess.run(["true"], check=True),
        TODAY: lambda: todays_launch(bwrap, today_dir),
        "local create+run(true)+destroy": local_cycle,
    }
    for label, backend in (("off", plain), ("on", cgrouped)):
        for ports in ((), (port,)):
            variants[f"bwrap create+destroy cgroup={label} ports={len(ports)}"] = (
                lambda b=backend, p=ports: b.create(SandboxSpec(allow_ports=p)).close()
            )
        variants[f"bwrap run(true) in a created sandbox, cgroup={label}"] = lambda sb=warm[label]: sb.run(["true"])
    for workdir in ("/root/.clawfast-bench/workspace", "/clawfast-bench-ws", "/usr/src/app"):
        variants[f"bwrap create+destroy cgroup=off workdir={workdir} ({rebuilt(plain, workdir)})"] = (
            lambda w=workdir: plain.create(SandboxSpec(workdir=w)).close()
        )
    variants["bwrap create+destroy without start probe, cgroup=on"] = lambda: unprobed.create(SandboxSpec()).close()
    if in_shm is not None:
        variants["bwrap create+destroy cgroup=on ports=0 base_dir=/dev/shm"] = lambda: in_shm.create(SandboxSpec()).close()
    try:
        samples = interleaved(variants, reps)
    finally:
        for sb in warm.values():
            sb.close()
        for b in (local, plain, cgrouped, unprobed, in_shm):
            if b is not None:
                b.close()
        listener.close()
        shutil.rmtree(today_dir, ignore_errors=True)
    pool = warm_pool_samples(reps, port, bwrap)
    rows = rows_of(samples, BASELINE, TODAY)
    rows += rows_of(pool, BASELINE + ALTERNATING, TODAY + ALTERNATING)
    return rows


def rows_of(samples: dict[str, list[float]], base_name: str, today_name: str) -> list[dict]:
    """One row per variant, its p50 over the p50s of the baselines timed in the same group."""
    base = statistics.median(samples[base_name])
    today = statistics.median(samples[today_name])
    return [
        {
            "name": name,
            "p50_ms": 1e3 * statistics.median(xs),
            "p99_ms": 1e3 * percentile(xs, 99),
            "ratio_p50_vs_baseline": statistics.median(xs) / base,
            "ratio_p50_vs_today": statistics.median(xs) / today,
        }
        for name, xs in samples.items()
    ]


def warm_pool_samples(reps: int, port: int, bwrap: str) -> dict[str, list[float]]:
    """Acquire (provision files into a warm sandbox) + release (destroy) through a SandboxPool with
    warm=2. Before each timed cycle it waits (untimed) for a warm sandbox, as a rollout of a few
    seconds would; both baselines are timed alternately with it."""
    spec = SandboxSpec(files={"task.txt": "t"}, allow_ports=(port,))
    name = "pool(warm=2) acquire+provision+destroy, cgroup=on ports=1"
    out: dict[str, list[float]] = {name: [], BASELINE + ALTERNATING: [], TODAY + ALTERNATING: []}
    today_dir = tempfile.mkdtemp(prefix=f"clawfast-bench-today-{os.getpid()}-")
    with SandboxPool("bwrap", max_concurrency=4, warm=2, warm_spec=spec) as pool:
        for i in range(reps + 5):
            deadline = time.monotonic() + 30
            while pool.warm_ready < 1 and time.monotonic() < deadline:
                time.sleep(0.002)
            t0 = time.perf_counter()
            with pool.sandbox(spec):
                pass
            t1 = time.perf_counter()
            subprocess.run(["true"], check=True)
            t2 = time.perf_counter()
            todays_launch(bwrap, today_dir)
            t3 = time.perf_counter()
            if i >= 5:
                out[name].append(t1 - t0)
                out[BASELINE + ALTERNATING].append(t2 - t1)
                out[TODAY + ALTERNATING].append(t3 - t2)
        assert pool.stats.warm_hits == reps + 5, pool.stats
    shutil.rmtree(today_dir, ignore_errors=True)
    return out


def throughput(rollouts: int, levels=(1, 8, 32)) -> list[dict]:
    rows = []
    for conc in levels:
        with SandboxPool("bwrap", max_concurrency=conc) as pool:
            def rollout(i: int) -> bool:
                with pool.sandbox(SandboxSpec(files={"task.txt": f"task {i}"}, name=f"r{i}")) as sb:
                    r = sb.run(["sh", "-c", "cat task.txt > answer.txt"], timeout=60)
                    return r.ok and sb.read_file("answer.txt") == f"task {i}".encode()

            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=conc) as ex:
                ok = sum(ex.map(rollout, range(rollouts)))
            elapsed = time.perf_counter() - t0
        rows.append({"concurrency": conc, "rollouts": rollouts, "ok": ok, "seconds": elapsed,
                     "rollouts_per_min": 60 * rollouts / elapsed})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rollouts", type=int, default=64)
    args = parser.parse_args()
    load_before = os.getloadavg()
    lat = latency(args.reps)
    thr = throughput(args.rollouts)
    load_after = os.getloadavg()

    print(f"cpus={os.cpu_count()} loadavg(1m) before={load_before[0]:.1f} after={load_after[0]:.1f} reps={args.reps}")
    width = max(len(r["name"]) for r in lat)
    print(f"{'latency':{width}s} {'p50 ms':>8s} {'p99 ms':>8s} {'p50 / subprocess':>17s} {'p50 / today':>12s}")
    for r in lat:
        print(f"{r['name']:{width}s} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{r['ratio_p50_vs_baseline']:17.1f} {r['ratio_p50_vs_today']:12.2f}")
    print()
    bar = [{"name": r["name"], "p50_ms": r["p50_ms"], "ok": r["p50_ms"] <= BAR_MS}
           for r in lat if "create+destroy" in r["name"] and not r["name"].startswith("local")]
    print(f"bar: create+destroy p50 <= {BAR_MS:.0f} ms")
    for b in bar:
        print(f"  {'ok  ' if b['ok'] else 'OVER'} {b['p50_ms']:7.2f} ms  {b['name']}")
    print()
    print("throughput: trivial loop over SandboxPool (create, run `cat task.txt > answer.txt`, read back, destroy)")
    print(f"{'concurrency':>11s} {'rollouts':>8s} {'ok':>4s} {'seconds':>8s} {'rollouts/min':>13s}")
    for r in thr:
        print(f"{r['concurrency']:11d} {r['rollouts']:8d} {r['ok']:4d} {r['seconds']:8.2f} {r['rollouts_per_min']:13.0f}")

    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_sandbox.json"), "w") as f:
        json.dump({"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after,
                   "reps": args.reps, "baselines": {"subprocess": BASELINE, "today": TODAY},
                   "bar_create_destroy_p50_ms": BAR_MS, "bar": bar, "latency": lat, "throughput": thr},
                  f, indent=2)


if __name__ == "__main__":
    main()
