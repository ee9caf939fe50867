"""hostile_cases_round4.py's cases on the disk tier (a server with --disk-kv-dir, write-through:
every computed chunk is a file at once) and the cases that start their own servers or scripts
(weights changed in place; a script that never closes its engine).

The disk cases find a prompt's chunk files by what appeared in the directory while it ran
(oldest first: the chain's order), then tamper with them as someone with write access to the
directory could, /flush_cache so the next read comes from disk, and ask again.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
from hostile_cases_round4 import (
    ADMIN,
    Round4Case,
    Target,
    post,
    rss_mb,
    watch_victim,
)

MODEL_DIR = Path.home() / ".cache/flowlang/models/smollm2-135m-instruct"
HEADER_NAME = slice(24, 40)  # disk_tier's header: magic 8, layout fingerprint 16, chunk name 16
HUGE_BYTES = 1 << 30


def _prompt(first: int) -> list[int]:
    return list(range(first, first + 600))  # several whole chunks


def greedy(url: str, ids: list[int], tenant: str = "a", timeout: float = 120) -> tuple:
    """8 greedy tokens after `ids`, with their logprobs (rounded: a chunked prefill may differ
    from a whole one in the last bits)."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    response = post(url, "/generate", body, tenant, timeout=timeout)
    if response.status_code != 200:
        return ("status", response.status_code)
    meta = response.json()["meta_info"]
    logprobs = tuple(round(x[0], 3) for x in meta["output_token_logprobs"])
    return tuple(response.json()["output_ids"]), logprobs


def chunk_files(disk_dir: str) -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in Path(disk_dir).glob("*/*.kv")}


def new_files(disk_dir: str, action) -> tuple[list[Path], object]:
    """Run `action()`; the chunk files it left (oldest first, once writing has settled)."""
    before = set(chunk_files(disk_dir))
    result = action()
    count, stable_since = -1, time.monotonic()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now = chunk_files(disk_dir)
        if len(now) != count:
            count, stable_since = len(now), time.monotonic()
        elif time.monotonic() - stable_since > 1.0:
            break
        time.sleep(0.2)
    files = chunk_files(disk_dir)
    return sorted((p for p in files if p not in before), key=files.get), result


def flush(url: str) -> None:
    httpx.post(url + "/flush_cache", headers=ADMIN, timeout=60)
    time.sleep(1.0)


def swapped_chunks(target: Target) -> dict:
    """#15: tenant A's chunk files copied under tenant B's chunk names (the header's name
    rewritten: only a crc32 of the payload guards it); B asks again."""
    url, d = target.url, target.disk_dir
    a_files, _ = new_files(d, lambda: greedy(url, _prompt(1000), "a"))
    b_files, fresh = new_files(d, lambda: greedy(url, _prompt(3000), "b"))
    flush(url)
    control = greedy(url, _prompt(3000), "b")  # read back from disk, untampered
    flush(url)
    for source, victim in zip(a_files, b_files, strict=False):
        data = bytearray(source.read_bytes())
        data[HEADER_NAME] = bytes.fromhex(victim.stem)
        victim.write_bytes(bytes(data))
    poisoned = greedy(url, _prompt(3000), "b")
    same = poisoned == fresh
    outcome = (
        f"{len(b_files)} files swapped; reload untampered "
        f"{'identical' if control == fresh else 'DIFFERS'}; after the swap "
        f"{'identical' if same else 'differs'}"
    )
    return {"outcome": outcome, "expected": same and bool(b_files)}


def huge_chunk(target: Target) -> dict:
    """#8: a 1 GiB (sparse) file under a chunk's name; its owner asks again while tenant B
    probes."""
    url, d = target.url, target.disk_dir
    files, fresh = new_files(d, lambda: greedy(url, _prompt(5000), "a"))
    flush(url)
    if not files:
        return {"outcome": "no chunk files written", "expected": False}
    files[0].unlink()
    with open(files[0], "wb") as file:
        file.truncate(HUGE_BYTES)
    peak_before = rss_mb(target.pid, "VmHWM")
    answer, victim_s = _owner_asks_while_b_probes(target, _prompt(5000))
    grew = rss_mb(target.pid, "VmHWM") - peak_before
    same = answer == fresh
    outcome = f"answer {'identical' if same else 'differs'}, peak RSS +{grew:.0f} MB"
    return {
        "outcome": outcome,
        "expected": same and grew < 256,
        "victim_s": victim_s,
        "health_s": target.health(),
    }


def fifo_chunk(target: Target) -> dict:
    """#8: a FIFO under a chunk's name; its owner asks again while tenant B probes. The
    FIFO is then opened for writing and closed, so a reader blocked on it sees its end."""
    url, d = target.url, target.disk_dir
    files, _ = new_files(d, lambda: greedy(url, _prompt(7000), "a"))
    flush(url)
    if not files:
        return {"outcome": "no chunk files written", "expected": False}
    files[0].unlink()
    os.mkfifo(files[0])
    out: dict = {}

    def trigger() -> None:
        try:
            out["r"] = greedy(url, _prompt(7000), "a", timeout=60)
        except httpx.HTTPError as err:
            out["r"] = repr(err)

    thread = threading.Thread(target=trigger, daemon=True)
    target.health()
    thread.start()
    victim_s = watch_victim(url, thread.is_alive)
    health_s = target.health()
    unblocked = _unblock(files[0])
    thread.join(timeout=30)
    outcome = f"owner's request {'answered' if 'r' in out else 'still held'}; " + (
        f"a reader was blocked on the FIFO ({unblocked}x)" if unblocked else "nobody read it"
    )
    return {"outcome": outcome, "expected": not unblocked, "victim_s": victim_s,
            "health_s": health_s}  # fmt: skip


def cold_prompt(target: Target) -> dict:
    """Control for #8: its owner sends a 600-token prompt nothing holds (no chunk file, not
    cached) while tenant B probes: what B waits behind any tenant's prompt being computed, as
    a bad chunk file's prompt is (the refused file costs its owner that recomputation)."""
    flush(target.url)
    answer, victim_s = _owner_asks_while_b_probes(target, _prompt(9000))
    answered = isinstance(answer, tuple) and answer[0] != "status"
    return {"outcome": "owner's request answered" if answered else "not answered",
            "expected": answered, "victim_s": victim_s, "health_s": target.health()}  # fmt: skip


def _owner_asks_while_b_probes(target: Target, ids: list[int]) -> tuple[object, float]:
    """Tenant A's greedy answer after `ids` (None if none came within 60 s), and tenant B's
    slowest probe meanwhile."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=greedy(target.url, ids, "a")))
    target.health()
    thread.start()
    victim_s = watch_victim(target.url, thread.is_alive)
    thread.join(timeout=60)
    return out.get("r"), victim_s


def _unblock(fifo: Path) -> int:
    """Open the FIFO for writing while readers wait on it (each then reads its end)."""
    opened = 0
    for _ in range(20):
        if not fifo.exists() or not stat.S_ISFIFO(fifo.stat().st_mode):
            break
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            opened += 1
        except OSError:  # ENXIO: no reader
            break
        time.sleep(0.2)
    return opened


# ------------------------------------------------------------------ own servers, own scripts


def changed_weights(target: Target) -> dict:
    """#9: a server on a copy of the model writes the prompt's chunks; the copy's K and V
    projections are then scaled in place (the files keep their sizes); a restart on the same
    --disk-kv-dir answers, against a server on an empty directory."""
    work = Path(target.work_dir) / "round4_weights"
    shutil.rmtree(work, ignore_errors=True)
    model = work / "model"
    shutil.copytree(MODEL_DIR, model)
    answers = []
    for stage, kv_dir in (("old", "kv"), ("changed", "kv"), ("fresh", "kv_fresh")):
        if stage == "changed":
            _scale_kv_projections(next(model.glob("*.safetensors")))
        flags = ["--model", str(model), "--disk-kv-dir", str(work / kv_dir)]
        server = target.launch([*flags, "--kv-write-policy", "write_through"])
        try:
            _, answer_ = new_files(
                str(work / kv_dir), lambda s=server: greedy(s.url, _prompt(9000))
            )
            answers.append(answer_)
        finally:
            server.stop()
    old, stale, fresh = answers
    same = stale == fresh
    outcome = (
        f"weights change the answer: {'yes' if old != fresh else 'NO'}; after the restart "
        f"{'identical to' if same else 'differs from'} a fresh computation"
    )
    shutil.rmtree(work, ignore_errors=True)
    return {"outcome": outcome, "expected": same and old != fresh}


def _scale_kv_projections(path: Path) -> None:
    """Halve every k_proj and v_proj weight in a safetensors file, in place."""
    import json

    with open(path, "r+b") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
        base = 8 + size
        for name, info in header.items():
            if not name.endswith(("k_proj.weight", "v_proj.weight")):
                continue
            begin, end = info["data_offsets"]
            file.seek(base + begin)
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
            tensor = torch.frombuffer(bytearray(file.read(end - begin)), dtype=dtype[info["dtype"]])
            file.seek(base + begin)
            file.write((tensor * 0.5).contiguous().view(torch.uint8).numpy().tobytes())


EXIT_SCRIPT = """
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.protocol import GenerateRequest, SamplingParams
engine = Engine(EngineConfig(model="smollm2-135m-instruct", max_kv_tokens=1024))
engine.generate(GenerateRequest(text="Hello", sampling=SamplingParams(max_new_tokens=4)))
"""  # and no engine.close()


def unclosed_engine(target: Target, runs: int = 4) -> dict:
    """A script that uses an engine and exits without closing it: its exit codes."""
    env = {**os.environ, "PYTHONPATH": target.tree, "HF_HUB_OFFLINE": "1"}
    codes = []
    for _ in range(runs):
        try:
            done = subprocess.run(
                [sys.executable, "-c", EXIT_SCRIPT],
                cwd=target.tree,
                env=env,
                capture_output=True,
                timeout=180,
            )
            codes.append(done.returncode)
        except subprocess.TimeoutExpired:
            codes.append("hang")
    clean = codes.count(0)
    return {"outcome": f"exit 0 in {clean} of {runs} runs {codes}", "expected": clean == runs}


DISK_CASES = [
    Round4Case("#15", "chunk files swapped across tenants", "poison", "disk", swapped_chunks),
    Round4Case("control", "cold 600-token prompt, no file", "stall", "disk", cold_prompt),
    Round4Case("#8", "1 GiB file under a chunk's name", "poison", "disk", huge_chunk),
    Round4Case("#8", "FIFO under a chunk's name", "stall", "disk", fifo_chunk),
]
OWN_CASES = [
    Round4Case("#9", "weights changed in place, restart", "poison", "own", changed_weights),
    Round4Case("extra", "script exits without engine.close()", "answer", "own", unclosed_engine),
]
