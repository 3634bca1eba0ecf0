"""Vision prompts (issue 33): Redis bytes and submit time per image prompt, worker memory with 1k distinct images.

    .venv/bin/python -m bench.bench_vision             # 500 + 1,000 prompts (~4-5 min on the 2-vCPU VM)
    .venv/bin/python -m bench.bench_vision --from-json bench/results/vision.json  # the section only

Writes bench/results/vision.json (+ vision.png) and rewrites its section of BENCHMARKS.md from that JSON.
Everything runs against a private ``redis-server --save ''`` on a free port, with the Qwen3 test tokenizer
(testing/tokenizer.py, with its ``preprocessor_config.json``: 16 px patches merged 2×2) and generated images —
photo-like JPEGs (smooth colour fields, shapes, sensor noise; quality 85) and screenshot-like PNGs (flat panels
and text), 512×384 to 1024×768, landscape and portrait.

1. **Submit** — ``producer submit`` (the function the CLI calls) of ``--prompts`` JSONL rows holding 1–3 images
   each as paths relative to the dataset (a share of them repeated across prompts), against the very same rows
   with the image parts removed (the baseline), alternating ``--repeat`` times (best of each counts). Per prompt:
   Redis memory (INFO ``used_memory`` delta over the submit; ``MEMORY USAGE`` summed over every key, and of the
   queue list alone; the messages' own length), submit wall and CPU time, and the bytes the image store received.
2. **Worker memory** — a real ``worker`` process (testing/fleet.py) against a simulator whose decode is slow
   enough that all ``--worker-prompts`` prompts, each with its own distinct image, are in flight together
   (``max_inflight`` = the prompt count, ``inflight_mode fixed``); its RSS (``/proc``: VmRSS sampled, VmHWM for
   the peak) over the run, against the same job text-only, again with a small ``THINKFLEET_IMAGE_CACHE_BYTES``,
   and again with that cache and a small ``THINKFLEET_IMAGE_INFLIGHT_BYTES`` (``--inflight-mib``: the byte budget
   of the images requests hold, taken before they are read, issue 43).
   The image cache's bytes are not exported by the worker: they are what the worker's own ``ImageSender``
   holds when replayed here over the same references in queue order with the same budget.

One file because a benchmark is one experiment: its two measurements share one run's images, tokenizer and
private Redis, and they, the baselines beside them and the section they write to BENCHMARKS.md are read, re-run
and regenerated together.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import redis

from bench.harness import (
    RESULTS,
    Sampler,
    bench_settings,
    code_version,
    loadavg,
    proc_cpu_s,
    scrape,
    sim_stats,
    start_workers,
    wait_for,
    worker_metrics_ports,
    write_json,
)
from bench.report import code_stamp, table, update_section
from producer import render
from producer.submit import submit
from producer.submit_options import SubmitOptions
from sglang_sim.testing import SimulatorProcess
from storage.images import MIME
from storage.reader import read_committed
from storage.schema import IMAGE_PATHS, IMAGE_SHA256
from testing.corpus import synthetic_text
from testing.datasets import write_jsonl
from testing.redis_process import RedisProcess
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.message import PromptTask
from thinkfleet.settings import Settings
from thinkfleet.vision import ImageRef

SIZES = ((512, 384), (640, 480), (800, 600), (1024, 768))
MAX_NEW_TOKENS = 64
MIB = 1 << 20
#: The worker's group-commit interval here: the last rows of a run are not left waiting the default's seconds.
FLUSH_INTERVAL_S = 2.0


# -- images and datasets ---------------------------------------------------------------------------------------
def _photo(w: int, h: int, rng: np.random.Generator, noise: np.ndarray) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.fromarray(rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 12))):
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = [x, y, x + int(rng.integers(20, w // 2)), y + int(rng.integers(20, h // 2))]
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    oy, ox = int(rng.integers(0, noise.shape[0] - h)), int(rng.integers(0, noise.shape[1] - w))
    pixels = np.asarray(img, dtype=np.int16) + noise[oy : oy + h, ox : ox + w]
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _screenshot(w: int, h: int, rng: np.random.Generator) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(200, 256, 3)))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(5, 15))):
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = [x, y, x + int(rng.integers(30, 300)), y + int(rng.integers(10, 120))]
        draw.rectangle(box, fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    for y in range(10, h, 18):
        if rng.random() < 0.6:
            line = "".join(chr(int(c)) for c in rng.integers(97, 123, int(rng.integers(10, 80))))
            draw.text((int(rng.integers(5, 40)), y), line, fill=(20, 20, 20))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_images(root: Path, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` distinct images under ``root/imgs``: 75 % photo-like JPEG, 25 % screenshot-like PNG."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(0, 12, size=(1100, 1100, 3)).astype(np.int16)  # cropped per image: sensor noise
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        w, h = SIZES[int(rng.integers(0, len(SIZES)))]
        if rng.random() < 0.2:
            w, h = h, w  # portrait
        photo = rng.random() < 0.75
        data = _photo(w, h, rng, noise) if photo else _screenshot(w, h, rng)
        name = f"imgs/{i:05d}.{'jpg' if photo else 'png'}"
        (root / name).write_bytes(data)
        out.append({"path": name, "bytes": len(data), "width": w, "height": h, "mime": "jpeg" if photo else "png"})
    return out


def image_rows(picks: list[list[int]], images: list[dict[str, Any]], seed: int) -> tuple[list[Any], list[Any]]:
    """(image rows, the same rows text-only): prompt ``i`` holds the images ``picks[i]`` then its question."""
    rng = np.random.default_rng(seed)
    with_images, text_only = [], []
    for i, chosen in enumerate(picks):
        text = synthetic_text(int(rng.integers(30, 150)), seed=seed * 100_003 + i)
        parts: list[dict[str, Any]] = [{"type": "image", "image": images[k]["path"]} for k in chosen]
        user = {"role": "user", "content": [*parts, {"type": "text", "text": text}]}
        with_images.append({"id": f"v{i:05d}", "messages": [user]})
        text_only.append({"id": f"v{i:05d}", "messages": [{"role": "user", "content": text}]})
    return with_images, text_only


def submit_picks(n: int, shared: int, repeat_share: float, seed: int) -> list[list[int]]:
    """1–3 images a prompt (50/30/20 %); each a ``shared`` popular image with ``repeat_share``, else a new one."""
    rng = np.random.default_rng(seed)
    fresh = shared
    picks = []
    for _ in range(n):
        chosen = []
        for _ in range(int(rng.choice([1, 2, 3], p=[0.5, 0.3, 0.2]))):
            if rng.random() < repeat_share:
                chosen.append(int(rng.integers(0, shared)))
            else:
                chosen.append(fresh)
                fresh += 1
        picks.append(chosen)
    return picks


# -- measuring -----------------------------------------------------------------------------------------------
def cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the render pools)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def queued(client: redis.Redis, queue: str) -> list[tuple[PromptTask, int]]:
    """Every queued message decoded as a worker would, with its length as stored, in consumption order."""
    out = []
    for raw in reversed(client.lrange(queue, 0, -1)):
        args = msgpack.unpackb(base64.b64decode(json.loads(raw)["body"]), raw=False)[0]
        out.append((PromptTask.from_args(args), len(raw)))
    return out


def key_bytes(client: redis.Redis) -> int:
    """``MEMORY USAGE`` summed over every key (the private server holds only what the submit wrote)."""
    return sum(int(client.memory_usage(k, samples=0) or 0) for k in client.scan_iter(count=1000))


def tree_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def proc_mem(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS, kept by the kernel) of a process, in bytes; the worker runs in one process."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def child_pids(pid: int) -> list[int]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def replay_cache(refs: list[ImageRef], root: str, budget: int) -> dict[str, int]:
    """The worker's own image cache (workers.images.ImageSender), fed ``refs`` in order with ``budget``: what it
    reads, encodes and keeps (the worker process does not export its cache's size)."""
    from workers.images import ImageSender

    sender = ImageSender(Settings(image_cache_bytes=budget))

    async def run() -> int:
        total = 0
        for ref in refs:
            total += len(await sender._uri(ref))  # the cache path prepare() takes for each image
        return total

    encoded = asyncio.run(run())
    return {"cached_bytes": sender.cached_bytes, "encoded_bytes": encoded, "reads": sender.reads, "hits": sender.hits}


# -- part 1: submit --------------------------------------------------------------------------------------------
def submit_once(
    client: redis.Redis, settings: Settings, data: Path, job: str, tok_dir: Path, processes: int | None
) -> dict[str, Any]:
    client.flushall()
    shutil.rmtree(settings.output_uri, ignore_errors=True)
    render._LOADED.clear()  # submit loads the tokenizer itself, as the CLI would
    opts = SubmitOptions(
        paths=[data],
        job=job,
        tokenizer=str(tok_dir),
        processes=processes,
        sampling={"max_new_tokens": MAX_NEW_TOKENS},
        context_length=131_072,
    )
    before = int(client.info("memory")["used_memory"])
    c0, t0 = cpu_s(), time.perf_counter()
    report = submit(settings, opts)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    after = int(client.info("memory")["used_memory"])
    if report.problems or not report.enqueued:
        raise RuntimeError(f"submit of {data.name} failed: {report.problems[:3]}")
    messages = queued(client, settings.queue)
    refs = [m for t, _ in messages for m in t.media]
    files, store = tree_bytes(Path(settings.output_uri) / job / "_images")
    return {
        "prompts": report.enqueued,
        "wall_s": wall,
        "cpu_s": cpu,
        "used_memory_delta": after - before,
        "queue_memory_usage": int(client.memory_usage(settings.queue, samples=0) or 0),
        "keys_memory_usage": key_bytes(client),
        "message_bytes": sum(size for _, size in messages),
        "prompt_tokens": report.prompt_tokens_enqueued,
        "image_refs": len(refs),
        "image_tokens": sum(r.tokens for r in refs),
        "distinct_images": len({r.sha256 for r in refs}),
        "store_files": files,
        "store_bytes": store,
        "estimated_redis_bytes": report.estimated_redis_bytes,
    }


def measure_submit(
    args: argparse.Namespace, work: Path, client: redis.Redis, url: str, tok_dir: Path, images: list[dict[str, Any]]
) -> dict[str, Any]:
    picks = submit_picks(args.prompts, args.shared_images, args.repeat_share, args.seed)
    img_rows, txt_rows = image_rows(picks, images, args.seed)
    data_img = write_jsonl(work / "vision.jsonl", img_rows)
    data_txt = write_jsonl(work / "text.jsonl", txt_rows)
    settings = Settings(redis_url=url, output_uri=str(work / "out-submit"))
    runs: dict[str, list[dict[str, Any]]] = {"text": [], "images": []}
    submit_once(client, settings, data_img, "warmup", tok_dir, args.processes)  # page cache, imports, Lua scripts
    for r in range(args.repeat):
        for name, data in (("text", data_txt), ("images", data_img)):
            res = submit_once(client, settings, data, f"{name}{r}", tok_dir, args.processes)
            runs[name].append(res)
            print(
                f"submit {name} #{r + 1}: {res['wall_s']:.2f} s ({res['cpu_s']:.2f} CPU s) for {res['prompts']} "
                f"prompts; Redis {res['used_memory_delta'] / res['prompts']:,.0f} B/prompt (used_memory), "
                f"messages {res['message_bytes'] / res['prompts']:,.0f} B; store {res['store_bytes'] / MIB:.1f} MiB",
                flush=True,
            )
    client.flushall()
    shutil.rmtree(settings.output_uri, ignore_errors=True)
    referenced = [images[k]["bytes"] for p in picks for k in p]
    out: dict[str, Any] = {
        "prompts": args.prompts,
        "repeat": args.repeat,
        "processes": args.processes or os.cpu_count(),
        "image_refs": len(referenced),
        "distinct_images": len({k for p in picks for k in p}),
        "referenced_image_bytes": sum(referenced),
        "runs": runs,
    }
    for name, rs in runs.items():
        best = min(rs, key=lambda x: x["wall_s"])
        n = best["prompts"]
        # Memory figures of the last run (they do not vary with load), times of the best.
        last = rs[-1]
        out[name] = {
            "submit_ms_per_prompt": round(1000 * best["wall_s"] / n, 3),
            "submit_cpu_ms_per_prompt": round(1000 * min(x["cpu_s"] for x in rs) / n, 3),
            "submit_s": round(best["wall_s"], 3),
            "redis_bytes_per_prompt_all_keys": round(last["used_memory_delta"] / n, 1),
            "redis_bytes_per_prompt_queue": round(last["queue_memory_usage"] / n, 1),
            "redis_bytes_per_prompt_keys": round(last["keys_memory_usage"] / n, 1),
            "message_bytes_per_prompt": round(last["message_bytes"] / n, 1),
            "prompt_tokens_per_prompt": round(last["prompt_tokens"] / n, 1),
            "image_tokens_per_prompt": round(last["image_tokens"] / n, 1),
            "store_files": last["store_files"],
            "store_bytes": last["store_bytes"],
            "estimated_redis_bytes_per_prompt": round(last["estimated_redis_bytes"] / n, 1),
        }
    i, t = out["images"], out["text"]
    refs = out["image_refs"]
    out["image_bytes_per_prompt"] = round(out["referenced_image_bytes"] / args.prompts, 1)
    out["redis_bytes_per_image_ref"] = round(
        (i["redis_bytes_per_prompt_all_keys"] - t["redis_bytes_per_prompt_all_keys"]) * args.prompts / refs, 1
    )
    out["message_bytes_per_image_ref"] = round(
        (i["message_bytes_per_prompt"] - t["message_bytes_per_prompt"]) * args.prompts / refs, 1
    )
    out["submit_ms_per_image_ref"] = round(
        (i["submit_ms_per_prompt"] - t["submit_ms_per_prompt"]) * args.prompts / refs, 3
    )
    return out


# -- part 2: worker memory -------------------------------------------------------------------------------------
def sim_flags(args: argparse.Namespace, tok_dir: Path) -> list[str]:
    """One simulated host whose decode is slow enough that every prompt is in flight at once."""
    return [
        "--time-scale", "1", "--decode-tok-s", "1e7", "--per-request-tok-s", str(args.per_request_tok_s),
        "--max-running-requests", str(2 * args.worker_prompts), "--prefill-tok-s", "1e9",
        "--length-median-tokens", str(args.output_tokens), "--length-sigma", "0", "--min-length-tokens", "4",
        "--max-tick-lag-ms", "1e12", "--log-level", "WARNING",
        "--tokenizer", str(tok_dir), "--model-family", "qwen3",
    ]  # fmt: skip


def worker_run(
    variant: str,
    data: Path,
    args: argparse.Namespace,
    work: Path,
    client: redis.Redis,
    url: str,
    tok_dir: Path,
    cache_bytes: int,
    inflight_bytes: int | None = None,
) -> dict[str, Any]:
    client.flushall()
    n = args.worker_prompts
    out_dir = work / f"out-{variant}"
    settings = bench_settings(url, str(out_dir)).with_overrides(max_inflight=n)
    job = f"mem-{variant}"
    sim = SimulatorProcess(*sim_flags(args, tok_dir)).start(timeout_s=180)  # a loaded box starts it slowly
    workers = []
    try:
        workers = start_workers(
            settings,
            [sim.url],
            n,
            work / "logs",
            inflight_mode="fixed",
            image_cache_bytes=cache_bytes,
            flush_interval_s=FLUSH_INTERVAL_S,
            **({"image_inflight_bytes": inflight_bytes} if inflight_bytes else {}),
        )
        pid = workers[0].proc.pid  # type: ignore[union-attr]
        port = next(iter(worker_metrics_ports(client, settings.keys).values()))

        def probe() -> dict[str, Any]:
            mem = proc_mem(pid)
            kids = sum(proc_mem(k).get("VmRSS", 0) for k in child_pids(pid))
            m = scrape(port)
            return {
                "rss": mem.get("VmRSS", 0),
                "children_rss": kids,
                "inflight": m.get("thinkfleet_inflight_requests", 0.0),
                "running": sim_stats(sim.url)["running"],
            }

        sampler = Sampler(probe, interval_s=args.sample_s).start()
        time.sleep(args.idle_s)
        cpu0 = proc_cpu_s(pid)
        render._LOADED.clear()
        opts = SubmitOptions(
            paths=[data],
            job=job,
            tokenizer=str(tok_dir),
            processes=args.processes,
            sampling={"max_new_tokens": args.output_tokens},  # every answer the same length: no stragglers
            context_length=131_072,
        )
        report = submit(settings, opts)
        t_commit = time.time()
        timeout = 120 + 3 * args.output_tokens / args.per_request_tok_s + n / 5
        wait_for(lambda: client.scard(settings.keys.done(job)) >= n, timeout, 0.1, f"{variant}: {n} prompts stored")
        t_done = time.time()
        cpu = proc_cpu_s(pid) - cpu0
        time.sleep(args.settle_s)  # what stays once no request is in flight
        hwm = proc_mem(pid).get("VmHWM", 0)
        samples = sampler.stop()
        sim_end = sim_stats(sim.url)
        dead = client.hlen(settings.keys.dead(job))
    finally:
        for w in workers:
            w.terminate(60)
        sim.stop()
        Path(sim.log_path).unlink(missing_ok=True)
    if report.enqueued != n or dead:
        raise RuntimeError(f"{variant}: {report.enqueued} enqueued, {dead} dead letters")
    ok = [s for s in samples if "error" not in s]
    idle = [s["rss"] for s in ok if s["t"] < t_commit - 0.5] or [ok[0]["rss"]]
    busy = [s for s in ok if t_commit <= s["t"] <= t_done]
    res: dict[str, Any] = {
        "cache_budget_bytes": cache_bytes if variant != "text" else None,
        "inflight_budget_bytes": inflight_bytes or Settings().image_inflight_bytes,
        "idle_rss_bytes": int(statistics.median(idle)),
        "peak_rss_bytes": int(max(hwm, *(s["rss"] for s in ok))),
        "median_rss_bytes": int(statistics.median(s["rss"] for s in busy)) if busy else None,
        "after_rss_bytes": int(statistics.median(s["rss"] for s in ok if s["t"] > t_done + args.settle_s / 2)),
        "peak_children_rss_bytes": int(max(s["children_rss"] for s in ok)),
        "peak_inflight": int(max(s["inflight"] for s in ok)),
        "sim_peak_running": int(sim_end["peak_running"]),
        "makespan_s": round(t_done - t_commit, 2),
        "worker_cpu_s": round(cpu, 2),
        "worker_cpu_ms_per_prompt": round(1000 * cpu / n, 2),
        "timeseries": {
            "t": [round(s["t"] - t_commit, 2) for s in ok],
            "rss_mib": [round(s["rss"] / MIB, 1) for s in ok],
            "inflight": [s["inflight"] for s in ok],
            "sim_running": [s["running"] for s in ok],
        },
    }
    # The image cache, replayed: the worker's ImageSender over the stored references in queue (= row) order.
    if variant != "text":
        rows = sorted(read_committed(str(out_dir), job).to_pylist(), key=lambda r: r["prompt_id"])
        refs = []
        for r in rows:
            for sha, path in zip(r[IMAGE_SHA256], r[IMAGE_PATHS], strict=True):
                refs.append(ImageRef(sha, path, MIME[path.rsplit(".", 1)[1]], 1, 1, 1, 0))
        root = os.path.dirname(os.path.dirname(refs[0].uri))
        res |= {f"replayed_{k}": v for k, v in replay_cache(refs, root, cache_bytes).items()}
        res["distinct_images"] = len({r.sha256 for r in refs})
        res["image_file_bytes"] = tree_bytes(Path(root))[1]
    shutil.rmtree(out_dir, ignore_errors=True)
    print(
        f"worker {variant}: RSS idle {res['idle_rss_bytes'] / MIB:.0f} MiB, peak {res['peak_rss_bytes'] / MIB:.0f} "
        f"MiB, median {(res['median_rss_bytes'] or 0) / MIB:.0f} MiB; in flight peak {res['peak_inflight']} "
        f"(sim {res['sim_peak_running']}); {res['makespan_s']} s; worker CPU {res['worker_cpu_ms_per_prompt']} "
        f"ms/prompt" + (f"; cache {res['replayed_cached_bytes'] / MIB:.0f} MiB" if variant != "text" else ""),
        flush=True,
    )
    return res


def measure_worker(
    args: argparse.Namespace, work: Path, client: redis.Redis, url: str, tok_dir: Path, images: list[dict[str, Any]]
) -> dict[str, Any]:
    picks = [[k] for k in range(args.worker_prompts)]  # one distinct image each
    img_rows, txt_rows = image_rows(picks, images, args.seed + 1)
    data_img = write_jsonl(work / "worker-vision.jsonl", img_rows)
    data_txt = write_jsonl(work / "worker-text.jsonl", txt_rows)
    default_budget = Settings().image_cache_bytes
    variants: list[tuple[str, Path, int, int | None]] = [
        ("text", data_txt, default_budget, None),
        ("images", data_img, default_budget, None),
    ]
    if args.small_cache_mib:
        variants.append(("images_small_cache", data_img, args.small_cache_mib * MIB, None))
        if args.inflight_mib:
            variants.append(("images_budget", data_img, args.small_cache_mib * MIB, args.inflight_mib * MIB))
    out: dict[str, Any] = {
        "prompts": args.worker_prompts,
        "image_bytes_mean": round(float(np.mean([images[p[0]]["bytes"] for p in picks])), 1),
        "per_request_tok_s": args.per_request_tok_s,
        "output_tokens": args.output_tokens,
        "default_cache_bytes": default_budget,
    }
    for name, data, budget, inflight in variants:
        out[name] = worker_run(name, data, args, work, client, url, tok_dir, budget, inflight)
    return out


# -- report ----------------------------------------------------------------------------------------------------
def _mib(b: float | None) -> str:
    return "–" if b is None else f"{b / MIB:,.0f}"


def _plot(f: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = f["worker"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    styles = {"text": "tab:grey", "images": "tab:blue", "images_small_cache": "tab:orange"}
    styles["images_budget"] = "tab:green"
    for name, colour in styles.items():
        if name not in w:
            continue
        ts = w[name]["timeseries"]
        label = {"text": "text only (baseline)", "images": "1 distinct image each, cache 256 MiB"}.get(
            name, f"1 distinct image each, cache {_mib(w[name]['cache_budget_bytes'])} MiB"
        )
        if name == "images_budget":
            label += f", in-flight budget {_mib(w[name]['inflight_budget_bytes'])} MiB"
        ax1.plot(ts["t"], ts["rss_mib"], color=colour, lw=1.2, label=label)
        ax2.plot(ts["t"], ts["inflight"], color=colour, lw=1.2)
    ax1.set_ylabel("worker RSS (MiB)")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.set_ylabel("requests in flight")
    ax2.set_xlabel("seconds since `producer submit` returned (its messages on the queue)")
    fig.suptitle(f"One worker, {w['prompts']:,} prompts in flight at once (Qwen3 test tokenizer, simulator)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _command_args(config: dict[str, Any]) -> str:
    """The run's arguments as the command line that repeats it (those a run recorded)."""
    flags = [("prompts", "--prompts"), ("worker_prompts", "--worker-prompts"), ("repeat", "--repeat"),
             ("small_cache_mib", "--small-cache-mib"), ("inflight_mib", "--inflight-mib")]  # fmt: skip
    return " ".join(f"{flag} {config[key]}" for key, flag in flags if key in config)


def markdown(f: dict[str, Any]) -> str:
    """The section of BENCHMARKS.md, from the saved figures."""
    s, w = f["submit"], f["worker"]
    t, i = s["text"], s["images"]
    n, refs = s["prompts"], s["image_refs"]
    sub_rows = [
        [
            name,
            f"{d['redis_bytes_per_prompt_all_keys']:,.0f}",
            f"{d['redis_bytes_per_prompt_keys']:,.0f}",
            f"{d['redis_bytes_per_prompt_queue']:,.0f}",
            f"{d['message_bytes_per_prompt']:,.0f}",
            f"{d['submit_ms_per_prompt']:.2f}",
            f"{d['submit_cpu_ms_per_prompt']:.2f}",
            f"{d['prompt_tokens_per_prompt']:,.0f}",
            f"{d['store_files']:,} / {d['store_bytes'] / MIB:.1f} MiB",
        ]
        for name, d in (("text only (baseline)", t), (f"with images ({refs / n:.2f} a prompt)", i))
    ]
    heads = [
        f"{n:,} prompts",
        "Redis B/prompt (used_memory Δ)",
        "Σ MEMORY USAGE of all keys, B/prompt",
        "queue list B/prompt",
        "message B",
        "submit ms/prompt (wall)",
        "submit CPU ms/prompt",
        "ids/prompt",
        "image store (files / bytes)",
    ]
    cpu_per_image = (i["submit_cpu_ms_per_prompt"] - t["submit_cpu_ms_per_prompt"]) * n / refs
    txt, img = w["text"], w["images"]
    small = w.get("images_small_cache")
    bounded = w.get("images_budget")
    rows_w = []
    labelled = ((txt, "text only (baseline)"), (img, "1 distinct image each"), (small, "1 distinct image each"),
                (bounded, "1 distinct image each"))  # fmt: skip
    for d, label in labelled:
        if d is None:
            continue
        cache = "–"
        if d.get("cache_budget_bytes") is not None:
            cache = f"{_mib(d['replayed_cached_bytes'])} of {_mib(d['cache_budget_bytes'])}"
        inflight = _mib(d["inflight_budget_bytes"]) if d.get("inflight_budget_bytes") and d is not txt else "–"
        rows_w.append(
            [
                label,
                cache,
                inflight,
                _mib(d["idle_rss_bytes"]),
                f"**{_mib(d['peak_rss_bytes'])}**",
                _mib(d["median_rss_bytes"]),
                _mib(d["after_rss_bytes"]),
                f"{d['peak_inflight']:,} / {d['sim_peak_running']:,}",
                f"{d['makespan_s']:.0f}",
                f"{d['worker_cpu_ms_per_prompt']:.1f}",
            ]
        )
    wheads = [
        f"{w['prompts']:,} prompts",
        "image cache MiB (replayed) of budget",
        "in-flight image budget MiB",
        "RSS idle MiB",
        "RSS peak MiB (VmHWM)",
        "RSS median MiB, submit → last row",
        f"RSS MiB {f['config']['settle_s']:g} s after",
        "peak in flight: worker / simulator",
        "makespan s",
        "worker CPU ms/prompt",
    ]
    extra = img["peak_rss_bytes"] - txt["peak_rss_bytes"]
    encoded = img["replayed_encoded_bytes"]
    all_cached = img["replayed_cached_bytes"] == encoded
    cache_note = (
        f"with the default `THINKFLEET_IMAGE_CACHE_BYTES` ({_mib(img['cache_budget_bytes'])} MiB) all stay cached"
        if all_cached
        else f"the default budget keeps {_mib(img['replayed_cached_bytes'])} MiB of them"
    )
    small_note = ""
    if small:
        small_note = f"""
- **The cache budget alone does not bound that.** With a {_mib(small["cache_budget_bytes"])} MiB cache (the
  replayed cache holds {_mib(small["replayed_cached_bytes"])} MiB) the peak is {_mib(small["peak_rss_bytes"])} MiB:
  a request in flight keeps its image alive whether or not the cache still does. What the cache budget bounds is
  what the worker keeps *between* requests, and RSS cannot show that here: {f["config"]["settle_s"]:g} s after the
  last row the worker holds {_mib(img["after_rss_bytes"])} MiB with {_mib(img["cache_budget_bytes"])} MiB of
  budget and {_mib(small["after_rss_bytes"])} MiB with {_mib(small["cache_budget_bytes"])} MiB (text:
  {_mib(txt["after_rss_bytes"])} MiB). CPython and glibc do not hand every freed buffer back to the system, so RSS
  is a ceiling on what is live, not a reading of it."""
    if small and bounded:
        small_note += f"""
- **The in-flight budget does.** With `THINKFLEET_IMAGE_INFLIGHT_BYTES` at {_mib(bounded["inflight_budget_bytes"])}
  MiB (and the {_mib(bounded["cache_budget_bytes"])} MiB cache) the peak is **{_mib(bounded["peak_rss_bytes"])}
  MiB**, {_mib(bounded["peak_rss_bytes"] - txt["peak_rss_bytes"])} MiB over text-only: at most the budget plus the
  cache, however many prompts are in flight. Each prompt's images are charged from their files' sizes before they
  are read, so a prompt that does not fit waits without reading anything; at most
  {bounded["peak_inflight"]:,} requests were in flight (the text-only run: {txt["peak_inflight"]:,}), and the job
  took {bounded["makespan_s"]:.0f} s against {img["makespan_s"]:.0f} s unbounded."""
    load = f.get("load_average_before_after", [[None], [None]])
    return f"""What it measures, in one run against a private `redis-server --save ''` (issue 33, part 6), with the
Qwen3 test tokenizer (`testing/tokenizer.py` and its `preprocessor_config.json`: 16 px patches merged 2×2)
and generated images: 75 % photo-like JPEGs (colour fields, shapes, sensor noise; quality 85) and 25 %
screenshot-like PNGs, 512×384 to 1024×768, a fifth of them portrait, {f["image_pool"]["bytes_mean"] / 1e3:.0f} kB
on average.

- **Submit**: `producer submit` (the function the CLI calls) of {n:,} JSONL rows with 1–3 images each
  (50/30/20 %), given as paths relative to the dataset. {s["repeat_share"]:.0%} of the references go to
  {s["shared_images"]} popular images, the rest to fresh ones ({refs:,} references, {s["distinct_images"]:,}
  distinct images, {s["referenced_image_bytes"] / MIB:.0f} MiB referenced). The baseline is **the same rows with
  the image parts removed**. The two alternate {s["repeat"]}× after a warm-up submit, and the best wall time of
  each counts. Redis is read three ways: `INFO used_memory` before and after the submit (everything it writes:
  queue, prompt hashes, job record), `MEMORY USAGE` summed over every key, and the queue list alone.
- **Worker memory**: a real `worker` process runs against a simulator slow enough that all {w["prompts"]:,}
  prompts, each with **its own distinct image** (mean {w["image_bytes_mean"] / 1e3:.0f} kB), are in flight
  together (`THINKFLEET_MAX_INFLIGHT={w["prompts"]}`, `inflight_mode fixed`; every answer {w["output_tokens"]}
  tokens at {w["per_request_tok_s"]:g} tok/s). The baseline is the same job text-only, a third run repeats
  the image job with a small image cache, and a fourth adds a small in-flight image budget. RSS comes from
  `/proc` (VmRSS sampled every {f["config"]["sample_s"]:g} s, VmHWM for the peak).

Command (~{f.get("elapsed_min", 0):.0f} min on the 2-vCPU VM):

    .venv/bin/python -m bench.bench_vision {_command_args(f["config"])}

Run {f.get("date", "?")}. {code_stamp(f.get("code"))} Machine: the shared 2-vCPU dev VM, 1-minute load
average {load[0][0]} → {load[1][0]} (other engineers' tests), so wall times carry that noise; CPU times are
given beside them.

Submit, per prompt ({s["processes"]} render processes):

{table(heads, sub_rows)}

- **Redis holds references, not images.** An image prompt costs {i["redis_bytes_per_prompt_all_keys"]:,.0f} B of
  Redis against {t["redis_bytes_per_prompt_all_keys"]:,.0f} B text-only, **+{s["redis_bytes_per_image_ref"]:,.0f} B
  per image**. {s["message_bytes_per_image_ref"]:,.0f} B of that is in the message (sha256, store URI, MIME type,
  size, token count and position, base64-wrapped by kombu). Its images weigh {s["image_bytes_per_prompt"] / 1e3:,.0f}
  kB, so Redis carries {i["redis_bytes_per_prompt_all_keys"] / s["image_bytes_per_prompt"]:.1%} of the image
  bytes. The image store got {i["store_files"]:,} files ({i["store_bytes"] / MIB:.1f} MiB), one per distinct image.
- **Submit time**: {i["submit_ms_per_prompt"]:.1f} ms per image prompt against {t["submit_ms_per_prompt"]:.1f} ms
  text-only, **+{s["submit_ms_per_image_ref"]:.1f} ms per image** on the wall clock and +{cpu_per_image:.1f} ms
  of CPU (the submit's own process and its render processes together). Each image is read, sniffed, sized and
  hashed, and each new one written into the store with two fsyncs (the file and its directory,
  `storage/layout.py` `write_atomic`).
- The ids grow from {t["prompt_tokens_per_prompt"]:,.0f} to {i["prompt_tokens_per_prompt"]:,.0f} a prompt (one
  placeholder run per image). The server expands them by {i["image_tokens_per_prompt"]:,.0f} image tokens a
  prompt, which the context checks budget. `--dry-run`'s Redis estimate is
  {i["estimated_redis_bytes_per_prompt"]:,.0f} B per image prompt and {t["estimated_redis_bytes_per_prompt"]:,.0f} B
  per text one.

Worker memory, {w["prompts"]:,} prompts in flight at once:

{table(wheads, rows_w)}

- **{w["prompts"]:,} distinct images in flight add {_mib(extra)} MiB** to the worker's peak RSS
  ({_mib(img["peak_rss_bytes"])} MiB against {_mib(txt["peak_rss_bytes"])} MiB text-only). That is
  {extra / encoded:.1f}× the images as sent: {encoded / MIB:,.0f} MiB of `data:` URIs
  ({img["image_file_bytes"] / MIB:,.0f} MiB of files, ×4/3 for base64), and {cache_note}. Each request in flight
  holds its image once: the encoded URI (the same bytes object the cache keeps), spliced into the `/generate`
  body as it is written (`workers/sglang.py` `body_pieces`), never copied into a serialised body. (Before issue
  43 each request also held an orjson body embedding it: 2.0× the encoded images, +243 MiB with 1,000.){small_note}
- So without a budget a worker's image memory in flight is about `THINKFLEET_MAX_INFLIGHT` × the mean encoded
  image; `THINKFLEET_IMAGE_INFLIGHT_BYTES` (default 1 GiB) caps it, taken before the images are read.
- The cache figures are replayed, not read from the worker, which exports no cache gauge: they come from the
  worker's own `ImageSender`, fed the same references in queue order with the same budget.
- Every prompt was stored and none was dead-lettered, in every run.

![worker RSS and requests in flight over time](bench/results/vision.png)

Raw figures: `bench/results/vision.json`.
"""


# -- main ------------------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    load_before = loadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    redis_proc = RedisProcess(work / "redis").start()
    client = redis_proc.client()
    try:
        tok_dir = build_test_tokenizer(default_test_tokenizer_dir(family="qwen3"), family="qwen3")
        picks = submit_picks(args.prompts, args.shared_images, args.repeat_share, args.seed)
        pool = max(args.worker_prompts, max(k for p in picks for k in p) + 1)
        t0 = time.perf_counter()
        images = make_images(work, pool, args.seed)
        print(
            f"{pool:,} images generated in {time.perf_counter() - t0:.0f} s, mean "
            f"{np.mean([m['bytes'] for m in images]) / 1e3:.0f} kB; load {loadavg()}",
            flush=True,
        )
        url = redis_proc.url()
        sub = measure_submit(args, work, client, url, tok_dir, images)
        sub |= {"shared_images": args.shared_images, "repeat_share": args.repeat_share}
        worker = measure_worker(args, work, client, url, tok_dir, images) if args.worker_prompts else {}
    finally:
        client.close()
        redis_proc.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "config": {
            "prompts": args.prompts,
            "worker_prompts": args.worker_prompts,
            "repeat": args.repeat,
            "seed": args.seed,
            "sample_s": args.sample_s,
            "settle_s": args.settle_s,
            "small_cache_mib": args.small_cache_mib,
            "inflight_mib": args.inflight_mib,
            "tokenizer": "qwen3 test tokenizer",
            "submit_max_new_tokens": MAX_NEW_TOKENS,
            "worker_max_new_tokens": args.output_tokens,
        },
        "image_pool": {
            "images": len(images),
            "bytes_mean": round(float(np.mean([m["bytes"] for m in images])), 1),
            "jpeg_share": round(sum(m["mime"] == "jpeg" for m in images) / len(images), 3),
        },
        "submit": sub,
        "worker": worker,
        "load_average_before_after": [load_before, loadavg()],
        "elapsed_min": round((time.monotonic() - started) / 60, 1),
    }


def summary(f: dict[str, Any]) -> str:
    s, w = f["submit"], f["worker"]
    line = (
        f"bench_vision: Redis {s['images']['redis_bytes_per_prompt_all_keys']:,.0f} B/image prompt vs "
        f"{s['text']['redis_bytes_per_prompt_all_keys']:,.0f} text (+{s['redis_bytes_per_image_ref']:,.0f} B/image; "
        f"images {s['image_bytes_per_prompt'] / 1e3:,.0f} kB/prompt); submit {s['images']['submit_ms_per_prompt']:.2f} "
        f"vs {s['text']['submit_ms_per_prompt']:.2f} ms/prompt"
    )
    if w:
        line += (
            f"; worker peak RSS {_mib(w['images']['peak_rss_bytes'])} MiB with {w['prompts']:,} distinct images in "
            f"flight vs {_mib(w['text']['peak_rss_bytes'])} text-only"
        )
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=500, help="image prompts of the submit measurement")
    ap.add_argument("--worker-prompts", type=int, default=1000, help="prompts in flight, 1 image each (0: skip)")
    ap.add_argument("--repeat", type=int, default=2, help="alternating text/image submits (best counts)")
    ap.add_argument("--shared-images", type=int, default=16, help="popular images that repeat across prompts")
    ap.add_argument("--repeat-share", type=float, default=0.2, help="share of image references to a popular image")
    ap.add_argument("--processes", type=int, default=None, help="submit's render processes (default: every core)")
    ap.add_argument("--per-request-tok-s", type=float, default=1.0, help="simulated decode speed of one request")
    ap.add_argument("--output-tokens", type=int, default=40, help="output tokens of every simulated answer")
    ap.add_argument("--small-cache-mib", type=int, default=32, help="a third worker run with this cache (0: skip)")
    ap.add_argument("--inflight-mib", type=int, default=16, help="a fourth run: that cache and this in-flight budget")
    ap.add_argument("--idle-s", type=float, default=3.0, help="sample the idle worker this long before the submit")
    ap.add_argument("--settle-s", type=float, default=4.0, help="keep sampling this long after the last prompt")
    ap.add_argument("--sample-s", type=float, default=0.25, help="RSS sampling interval")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS / "vision.json", help="the figures (JSON)")
    ap.add_argument("--no-markdown", action="store_true", help="don't rewrite the BENCHMARKS.md section")
    ap.add_argument("--from-json", type=Path, help="only rewrite the section from a saved run (runs nothing)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (datasets, logs)")
    args = ap.parse_args()
    if args.from_json:
        figures = json.loads(args.from_json.read_text())
    else:
        code = code_version()  # the tree as the run starts
        figures = measure(args) | {"date": time.strftime("%Y-%m-%d"), "code": code}
        write_json(args.out, figures)
        if figures["worker"]:
            try:
                _plot(figures, args.out.with_suffix(".png"))
            except ImportError as exc:
                print(f"bench_vision: plot skipped ({exc.name} is not installed: pip install -e '.[bench]')")
    if not args.no_markdown and figures["worker"]:
        update_section("bench_vision", "Vision prompts: Redis, submit and worker memory", markdown(figures))
    print(summary(figures), f"→ {args.out}")


if __name__ == "__main__":
    main()
