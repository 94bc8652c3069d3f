"""Fixtures shared by every test package: the real-vLLM venv and the transformers reference,
and the persistent JAX compilation cache of the test session.

Compiling is most of the suite's time on CPU (tiny models, many programs). The session points
JAX's persistent cache at `~/.cache/jfp8rl/jax-test-cache/<jax version, host CPU>` (next to the
cached vLLM venv; `JFP8RL_TEST_JAX_CACHE=<dir>` to choose another, `=off` for none), for this
process and, through the environment, for every JAX subprocess the tests start: a rerun on the
same machine loads the executables instead of compiling them. An executable is keyed by its
program, compile options and jax/XLA version, so a hit runs the very program a compile would
give; the numbers the tests compare do not change.

Under pytest-xdist (`scripts/test.sh` runs three workers, `--dist loadgroup`) a test file is the
unit of scheduling, so its module fixtures are built once; tests that share one session
resource (a server, the real model) are grouped across files by their conftest. Files holding
`slow` tests go first, so the long ones do not end up last on one worker while the other idles.

The real-vLLM venv and the transformers reference live in the vLLM venv
(`scripts/setup_vllm_env.sh`, Python 3.11 with torch 2.13 cpu and transformers; the project venv
has no torch). Tests that need it never skip silently: they skip
only when `JFP8RL_SKIP_VLLM=1` is set, and otherwise build the venv (cached) or fail loudly.
"""

from __future__ import annotations

import gc
import hashlib
import os
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "rollout_bridge"))
sys.path.insert(0, str(TESTS / "reference"))


def _jax_test_cache() -> str:
    """The persistent compilation cache folder (module docstring); "" when off."""
    chosen = os.environ.get("JFP8RL_TEST_JAX_CACHE", "")
    if chosen == "off":
        return ""
    if chosen:
        return chosen
    # XLA:CPU executables hold code for the host's instruction set: one folder per CPU model
    # and feature set, so a cache carried to another machine type is not read (XLA's loader
    # would refuse its entries, with an error line each).
    cpu = platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        for field in ("model name", "flags"):
            cpu += next((line for line in info if line.startswith(field)), "")
    except OSError:
        pass
    from importlib.metadata import version

    key = f"{version('jax')}-{version('jaxlib')}-{cpu}"
    tag = f"jax{version('jax')}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return str(Path.home() / ".cache" / "jfp8rl" / "jax-test-cache" / tag)


def _use_fast_compiles() -> None:
    """XLA:CPU's LLVM at -O0 for this process and every JAX subprocess the tests start.

    Compiling is most of the suite's time, and LLVM's optimisation of the generated code is
    about a third of that; the tiny programs run about as fast unoptimised. The HLO programs
    are the same; only the machine code differs (at -O3 LLVM may fuse a multiply and an add
    into one FMA), so a float may differ in its last bits from the build a user runs. The tests
    compare against independent references with tolerances, or runs within the suite against
    each other, never against a result of the -O3 build.
    `JFP8RL_TEST_XLA_OPT=<0-3>` chooses another level (3 = the default build)."""
    level = os.environ.get("JFP8RL_TEST_XLA_OPT", "0")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level={level}".strip()


CACHE_LIMIT_BYTES = 4 << 30


def _prune_jax_test_cache(path: str, limit: int = CACHE_LIMIT_BYTES) -> None:
    """Deletes the oldest entries (by modification time) until the cache holds <= `limit`
    bytes. Once per session, before any test: JAX's own bound (`jax_compilation_cache_max_size`)
    rescans the whole folder under a file lock at every write, which over the suite's thousands
    of small programs costs minutes and serialises the workers."""
    entries = []
    for f in Path(path).glob("*"):
        try:
            st = f.stat()
        except OSError:  # removed meanwhile
            continue
        entries.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in entries)
    for _, size, f in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        f.unlink(missing_ok=True)
        total -= size


def _use_jax_test_cache() -> None:
    path = _jax_test_cache()
    if not path:
        return
    # Every program (the default caches only those compiling for over 1 s), unbounded while the
    # session runs (no lock, no rescan per write; `_prune_jax_test_cache` bounds it between
    # sessions). A half-written entry read by another process fails to load and is recompiled.
    settings = {
        "JAX_COMPILATION_CACHE_DIR": path,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    os.environ.update(settings)  # the JAX subprocesses the tests start
    import jax

    # This process: before its first compile, which fixes whether the cache is used.
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


_use_fast_compiles()
_use_jax_test_cache()


def pytest_configure(config: pytest.Config) -> None:
    """The session's controller (not an xdist worker) bounds the compilation cache once,
    before any test writes to it."""
    path = _jax_test_cache()
    if path and not hasattr(config, "workerinput") and Path(path).is_dir():
        _prune_jax_test_cache(path)


_frozen_for: list[str] = [""]  # the test file whose start last froze the worker's objects
_SESSION_FREEZE = pytest.StashKey[object]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """The worker is one long run to `objects_before_frozen`: entered here, left at the end, so
    the runs the tests make in this process nest inside it and neither collect nor unfreeze."""
    from jfp8rl.observe.memory import objects_before_frozen

    session.stash[_SESSION_FREEZE] = freeze = objects_before_frozen()
    freeze.__enter__()


def pytest_sessionfinish(session: pytest.Session) -> None:
    freeze = session.stash.get(_SESSION_FREEZE, None)
    if freeze is not None:
        freeze.__exit__(None, None, None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """At the first test of each file: collect what the earlier files left, then freeze the rest.

    A worker keeps every earlier test's imports, traces and compiled programs alive (millions
    of objects), and each full collection walks what is not frozen: Python's automatic ones
    and each training stage's (`release_free_heap`) took a second or more each, minutes over
    the suite. Frozen, they are out of that walk; only the objects of the running file are in
    it. (An object frozen here that becomes cyclic garbage later stays until the worker ends.)"""
    path = item.nodeid.split("::")[0]
    if path != _frozen_for[0]:
        _frozen_for[0] = path
        gc.collect()
        gc.freeze()


# Session fixtures worth building once: their users form one xdist group (one worker), so the
# tiny vLLM server starts once and the real models' transformers references are computed once.
# The two real models share a group: their trainers and vLLM servers (a 0.5B trainer holds
# ~14 GB) run one at a time, never side by side on one machine's memory.
SHARED_FIXTURES = {
    "tiny_vllm": "tiny_vllm",
    "smollm2_dir": "real_models",
    "qwen25_dir": "real_models",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """xdist groups (module docstring): the shared fixture an item uses, else its file; the
    shared fixtures' groups and those holding `slow` tests first, each keeping its order."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        used = [g for f, g in SHARED_FIXTURES.items() if f in getattr(item, "fixturenames", ())]
        name = used[0] if used else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(name))
        groups.setdefault(name, []).append(item)

    def heavy(name: str) -> bool:
        return name in SHARED_FIXTURES.values() or any(
            i.get_closest_marker("slow") for i in groups[name]
        )

    order = [n for n in groups if heavy(n)] + [n for n in groups if not heavy(n)]
    items[:] = [item for name in order for item in groups[name]]


def skip_vllm() -> bool:
    return os.environ.get("JFP8RL_SKIP_VLLM") == "1"


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM venv, built or refreshed by scripts/setup_vllm_env.sh."""
    if skip_vllm():
        pytest.skip("JFP8RL_SKIP_VLLM=1: real-vLLM / transformers tests disabled")
    from bridge_support import ensure_vllm_env

    return ensure_vllm_env()


@pytest.fixture(scope="session")
def transformers_ref(vllm_venv: Path) -> Iterator[Callable[..., tuple[dict, dict]]]:
    """`transformers_ref(kind, arrays=..., **fields) -> (meta, arrays)`: a job of
    tests/reference/transformers_ref.py run in the vLLM venv, all of the session's in one
    worker process (see tests/reference/client.py)."""
    from client import ReferenceWorker

    worker = ReferenceWorker()
    yield worker
    worker.close()


def _get_model(script_name: str) -> Path:
    """The HF folder a scripts/get_*.sh script prints last (cached under ~/.cache/jfp8rl;
    minutes the first time)."""
    import subprocess

    script = TESTS.parent / "scripts" / script_name
    proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def smollm2_dir(vllm_venv: Path) -> Path:
    """SmolLM2-135M-Instruct (4-bit GGUF weights dequantized to f32) as an HF folder, from
    scripts/get_smollm2.sh."""
    return _get_model("get_smollm2.sh")


@pytest.fixture(scope="session")
def qwen25_dir(vllm_venv: Path) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF weights dequantized to f32) as an HF folder,
    from scripts/get_qwen25_coder_05b.sh."""
    return _get_model("get_qwen25_coder_05b.sh")


@pytest.fixture(scope="session")
def qwen25_ref(qwen25_dir: Path, transformers_ref: Callable) -> tuple[dict, dict]:
    """transformers' Qwen2.5-Coder on every case of tests/reference/qwen25_cases.py (one job for
    the session), loaded from the folder its GGUF loader wrote (dequantizing the GGUF again costs
    ~40 s); the greedy prompts rendered by our chat template."""
    import qwen25_cases as cases
    from smollm2_cases import reference

    from jfp8rl.data.records import Example
    from jfp8rl.data.templates import PromptFormat
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(qwen25_dir)
    fmt = PromptFormat(qwen25_dir, tok)
    prompts = [fmt.encode([Example("", "", {}, tuple(c))], 512)[0] for c in cases.GREEDY]
    meta, arrays = reference(
        transformers_ref, tok, prompts, model_dir=qwen25_dir, texts=cases.TEXTS,
        conversations=cases.CONVERSATIONS, max_new_tokens=cases.MAX_NEW_TOKENS,
    )  # fmt: skip
    return {**meta, "prompts": prompts}, arrays


@pytest.fixture(scope="session")
def smollm2_ref(smollm2_dir: Path, transformers_ref: Callable) -> tuple[dict, dict]:
    """transformers' GGUF-loaded SmolLM2 on every case of tests/reference/smollm2_cases.py:
    (meta, arrays) of job `gguf`, one job for the session. The greedy prompts are GREEDY
    rendered by our chat template (`jfp8rl.data.templates.PromptFormat`)."""
    from smollm2_cases import GREEDY, reference

    from jfp8rl.data.records import Example
    from jfp8rl.data.templates import PromptFormat
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    fmt = PromptFormat(smollm2_dir, tok)
    prompts = [fmt.encode([Example("", "", {}, tuple(c))], 512)[0] for c in GREEDY]
    meta, arrays = reference(transformers_ref, tok, prompts)
    return {**meta, "prompts": prompts}, arrays
