"""Hostile testing, fourth round (issue 50): the disk tier trusts nothing it reads, and a script
that never closes its engine exits cleanly.

- #8: a FIFO, a symlink, a directory or a huge file under a chunk's name is a bounded miss:
  never a hang, never read past a chunk's size.
- #9: weights changed in place (same sizes, same mtime) name their KV differently.
- #15: a chunk file copied or crafted under another chunk's name, or from another deployment,
  fails its keyed MAC; the key is private and a world-writable directory is refused.
- exit: an engine left open at exit is closed before the interpreter's teardown (SIGABRT
  before).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import runtime
from runtime.cache.chunks import TierLayout
from runtime.cache.disk_tier import DiskTier
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import UsageError
from runtime.protocol import GenerateRequest, SamplingParams

CODE = Path(runtime.__file__).resolve().parents[1]  # the code under test, for subprocesses
LAYOUT = TierLayout("hostile-model", 2, 1, 4, torch.float32, page_size=16)  # 1 KiB chunks
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0)
PROMPT = [(7 * i) % 400 + 3 for i in range(100)]  # 6 whole chunks of 16


def make_tier(root: Path) -> DiskTier:
    return DiskTier(root, LAYOUT, capacity_bytes=1 << 20)


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed))


def name(k: int) -> bytes:
    return bytes([k]) * 16


def read_in_thread(disk: DiskTier, key: bytes, timeout: float = 10.0):
    """disk.read(key) on a daemon thread: (finished, result)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(disk.read(key)), daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), out[0] if out else None


def unblock_fifo(path: Path) -> None:
    """Give a reader stuck opening the FIFO a writer that closes at once (EOF)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader waiting


# ---------------------------------------------------------------- #8: bounded, regular reads
def test_a_fifo_under_a_chunk_name_is_a_miss_not_a_hang(tmp_path):
    disk = make_tier(tmp_path)
    fifo = disk.path(name(1))
    os.mkfifo(fifo)
    try:
        finished, result = read_in_thread(disk, name(1))
    finally:
        unblock_fifo(fifo)
    assert finished, "reading a FIFO under a chunk's name blocked"
    assert result is None and disk.num_bad_files == 1
    # one there at start is not indexed as a chunk either
    os.mkfifo(disk.path(name(2)))
    again = make_tier(tmp_path)
    assert len(again) == 0 and not again.contains(name(2))


def test_a_huge_file_under_a_chunk_name_is_not_read_whole(tmp_path):
    disk = make_tier(tmp_path)
    with open(disk.path(name(1)), "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB to read, no disk used
    tracemalloc.start()
    try:
        result = disk.read(name(1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result is None and disk.num_bad_files == 1
    assert peak < 4 << 20, f"{peak} bytes allocated to refuse a 64 MiB file"


def test_a_symlink_or_a_directory_under_a_chunk_name_is_a_miss(tmp_path):
    disk = make_tier(tmp_path / "kv")
    assert disk.write(name(1), chunk(1))
    elsewhere = tmp_path / "elsewhere.kv"
    shutil.move(disk.path(name(1)), elsewhere)
    disk.path(name(1)).symlink_to(elsewhere)  # a valid chunk file, but through a link
    assert disk.read(name(1)) is None
    disk.path(name(2)).mkdir()
    assert disk.read(name(2)) is None  # a miss, not an IsADirectoryError
    assert disk.num_bad_files == 2
    assert elsewhere.is_file()  # the link's target is left alone


def disk_engine_settings(disk_dir: Path) -> dict:
    """A tiny engine writing its KV through to chunk files in `disk_dir`."""
    return {
        "model": "random:tiny",
        "max_kv_tokens": 512,
        "attention_backend": "torch",
        "disk_kv_dir": str(disk_dir),
        "kv_write_policy": "write_through",
    }


def test_a_fifo_on_disk_does_not_hang_the_engine(tmp_path):
    """The engine reads chunk files on its loop thread: a FIFO there held every tenant (now it
    is not even taken for a chunk: only regular files are)."""
    settings = disk_engine_settings(tmp_path)
    request = GenerateRequest(input_ids=PROMPT, sampling=GREEDY)
    with Engine(EngineConfig(**settings)) as engine:
        [cold] = engine.generate(request)
        first = engine.tiers.disk.path(engine.tiers.names(None, PROMPT, len(PROMPT))[0])
    first.unlink()
    os.mkfifo(first)
    engine = Engine(EngineConfig(**settings))
    try:
        handle = engine.submit(GenerateRequest(input_ids=PROMPT, sampling=GREEDY))
        done = threading.Event()
        threading.Thread(target=lambda: (handle.result(), done.set()), daemon=True).start()
        finished = done.wait(30)
        unblock_fifo(first)
        assert finished, "a FIFO among the chunk files stalled the engine"
        warm = handle.result()
        assert warm.output_ids == cold.output_ids and warm.loaded_tokens == 0
    finally:
        unblock_fifo(first)
        engine.close()


@pytest.mark.parametrize("host_kv_gb", [0.0, 0.001])
def test_chunk_files_are_read_off_the_loop_thread(tmp_path, monkeypatch, host_kv_gb):
    """#8, the last part: a restart that answers from disk reads every chunk file on the
    prefetch thread (before: admission read them on the engine's loop thread, so a slow or
    hostile file held every tenant's step), with or without host memory to read them into;
    admission waits for them (if the queue's prefetch has not read them already) and loads
    them, so the answer is the same and nothing of the prompt's whole chunks is computed."""
    settings = {**disk_engine_settings(tmp_path), "host_kv_gb": host_kv_gb}
    request = GenerateRequest(input_ids=PROMPT, sampling=GREEDY)
    with Engine(EngineConfig(**settings)) as engine:
        [cold] = engine.generate(request)
    readers: list[str] = []
    read = DiskTier.read

    def recorded(self, key):
        readers.append(threading.current_thread().name)
        return read(self, key)

    monkeypatch.setattr(DiskTier, "read", recorded)
    with Engine(EngineConfig(**settings)) as engine:
        [warm] = engine.generate(request)
        chunk_tokens = engine.tiers.chunk_tokens
    assert warm.output_ids == cold.output_ids
    assert warm.loaded_tokens == len(PROMPT) // chunk_tokens * chunk_tokens > 0
    assert readers and set(readers) == {"kv-prefetch"}, readers


# ---------------------------------------------------------------- #9: weights by content
def rewrite_weights_in_place(model_dir: Path) -> None:
    """Other values, same tensors, same file size, the old mtime put back."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    before = path.stat()
    weights = load_file(path)
    weights = {k: (-v if v.dim() == 2 else v) for k, v in weights.items()}
    save_file(weights, path, metadata={"format": "pt"})
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_weights_changed_in_place_do_not_read_the_old_kv(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("FLOWLANG_CACHE_DIR", str(tmp_path / "cache"))
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    settings = {
        "model": str(model),
        "max_kv_tokens": 512,
        "attention_backend": "torch",
        "disk_kv_dir": str(tmp_path / "kv"),
        "kv_write_policy": "write_through",
    }
    request = GenerateRequest(input_ids=PROMPT, sampling=GREEDY)
    with Engine(EngineConfig(**settings)) as engine:
        engine.generate(request)
        old = engine.tiers.fingerprint
    with Engine(EngineConfig(**settings)) as engine:
        assert engine.generate(request)[0].loaded_tokens == 96  # same weights: warm
    rewrite_weights_in_place(model)
    with Engine(EngineConfig(**settings)) as engine:
        assert engine.tiers.fingerprint != old
        [warm] = engine.generate(request)
        engine.flush_cache()
    assert warm.loaded_tokens == 0  # computed with the new weights, never the old KV


def test_the_weights_digest_is_remembered_across_restarts(tmp_path, tiny_model_dir, monkeypatch):
    from runtime.model import loader

    monkeypatch.setenv("FLOWLANG_CACHE_DIR", str(tmp_path / "cache"))
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    first = loader.checkpoint_digest(model)

    def no_reading(*args, **kwargs):
        raise AssertionError("the weights were read again")

    with monkeypatch.context() as patch:
        patch.setattr(loader, "open", no_reading, raising=False)
        assert loader.checkpoint_digest(model) == first
    rewrite_weights_in_place(model)
    assert loader.checkpoint_digest(model) != first


# ---------------------------------------------------------------- #15: keyed MACs
def test_a_chunk_file_crafted_under_another_chunks_name_fails_its_mac(tmp_path):
    """Names are computable: copy A's file under B's name with B's name in its header."""
    disk = make_tier(tmp_path)
    assert disk.write(name(1), chunk(1)) and disk.write(name(2), chunk(2))
    forged = disk.path(name(1)).read_bytes().replace(name(1), name(2))
    disk.path(name(2)).write_bytes(forged)
    assert disk.read(name(2)) is None and disk.num_bad_files == 1
    assert torch.equal(disk.read(name(1)), chunk(1))


def test_chunk_files_of_another_deployment_are_misses(tmp_path):
    mine, theirs = make_tier(tmp_path / "mine"), make_tier(tmp_path / "theirs")
    assert theirs.write(name(1), chunk(1))
    shutil.copy(theirs.path(name(1)), mine.path(name(1)))
    assert mine.read(name(1)) is None and mine.num_bad_files == 1


def test_the_key_is_private_and_a_world_writable_directory_is_refused(tmp_path):
    from runtime.cache.disk_files import KEY_FILE

    root = tmp_path / "kv"
    make_tier(root)
    key = root / KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    key.chmod(0o644)
    with pytest.raises(UsageError, match="must be the serving user's"):
        make_tier(root)
    key.chmod(0o600)
    root.chmod(0o777)
    with pytest.raises(UsageError, match="writable by every user"):
        make_tier(root)


# ---------------------------------------------------------------- exit without close()
EXIT_SCRIPT = textwrap.dedent(
    """
    import sys
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    engine = Engine(model=sys.argv[1], device="cpu", max_kv_tokens=2048)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    print(engine.generate([GenerateRequest(text="Hello there", sampling=params)])[0].text)
    if sys.argv[2] == "in-flight":  # the loop thread is inside torch as the script ends
        params = SamplingParams(max_new_tokens=500, ignore_eos=True)
        engine.submit(GenerateRequest(text="Hello there " * 40, sampling=params))
    """
)


@pytest.mark.parametrize("runs", [4, pytest.param(20, marks=pytest.mark.slow)])
def test_a_script_that_never_closes_its_engine_exits_cleanly(tmp_path, tiny_model_dir, runs):
    """Half the runs end with a request in flight (SIGABRT every time before), half idle
    (once in four, at best, before). `pytest -m slow` runs the issue's 20 of 20."""
    script = tmp_path / "no_close.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(CODE)}

    def run(k: int) -> tuple[int, str]:
        mode = "in-flight" if k % 2 else "idle"
        argv = [sys.executable, str(script), str(tiny_model_dir), mode]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        return done.returncode, done.stderr[-400:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(run, range(runs)))
    failures = [(rc, err) for rc, err in outcomes if rc != 0]
    assert not failures, f"{len(failures)} of {runs} runs failed: {failures[:2]}"
