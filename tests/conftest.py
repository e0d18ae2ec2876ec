"""Shared fixtures: where the reference vectors live, a tiny official-layout model directory, and the
suite-wide guard that fails a test whose code logged an unexpected traceback."""

from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("VOICERTC_GOLDEN") or REPO.parent / "shared" / "golden")


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores: a test
    asking torch for more threads than that would only oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    try:
        import torch
    except ImportError:
        return
    share = max(1, (os.cpu_count() or 2) // workers)
    set_threads = torch.set_num_threads
    torch.set_num_threads = lambda n: set_threads(min(int(n), share))  # type: ignore[assignment]
    torch.set_num_threads(share)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# --- no unexpected tracebacks (every test) ----------------------------------------------------------


class _ErrorRecords(logging.Handler):
    """Collects ERROR records that carry a traceback, and asyncio's "... exception was never retrieved"."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "never retrieved" in record.getMessage():
            self.records.append(record)


class ExpectedErrors:
    """What a test declares it provokes: `allow(pattern)` lets matching ERROR tracebacks through."""

    def __init__(self, patterns: tuple[str, ...] = ()) -> None:
        self.patterns = list(patterns)
        self.allow_all = False

    def allow(self, pattern: str = "") -> None:
        """Allow records whose message or exception matches `pattern` (a regex; "" = any)."""
        if pattern:
            self.patterns.append(pattern)
        else:
            self.allow_all = True

    def expected(self, record: logging.LogRecord) -> bool:
        if self.allow_all:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = f"{record.getMessage()}\n{type(exc).__name__ if exc else ''}: {exc or ''}"
        return any(re.search(p, text) for p in self.patterns)


@pytest.fixture
def expected_errors(request) -> ExpectedErrors:
    """Opt-out for a test that provokes errors on purpose: `expected_errors.allow("pattern")`."""
    return request.node._expected_errors


@pytest.fixture(scope="module", autouse=True)
def module_garbage():
    """Collect, once at the module's end, what its tests left to the module (`no_unexpected_tracebacks`
    freezes what exists before each test): with torch, transformers and the models imported a full
    collection walks ~1M objects (0.2-0.4 s), which once a test was a third of the model tests' time.
    An unretrieved task exception that surfaces only here fails the module's last test."""
    yield
    handler = _ErrorRecords()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        gc.unfreeze()
        gc.collect()
    finally:
        root.removeHandler(handler)
    never_retrieved = [r for r in handler.records if "never retrieved" in r.getMessage()]
    if never_retrieved:
        pytest.fail(f"unretrieved task exception(s) at the module's end: {never_retrieved[0].getMessage()}")


@pytest.fixture(autouse=True)
def no_unexpected_tracebacks(request):
    """Fail a test whose code logged an ERROR with a traceback, or an unretrieved task exception,
    that it did not declare (`@pytest.mark.expected_errors("regex", ...)` or the `expected_errors`
    fixture). Garbage is collected first, so tasks dropped by the test report before the check: what
    existed before the test is frozen (`gc.freeze`; `module_garbage` collects it at the module's end),
    so the collection walks only what the test and its fixtures made, in microseconds."""
    marker = request.node.get_closest_marker("expected_errors")
    expected = ExpectedErrors(tuple(marker.args) if marker else ())
    if marker is not None and not marker.args:
        expected.allow()
    request.node._expected_errors = expected
    handler = _ErrorRecords()
    root = logging.getLogger()
    root.addHandler(handler)
    gc.freeze()
    try:
        yield
        gc.collect()
    finally:
        root.removeHandler(handler)
    unexpected = [r for r in handler.records if not expected.expected(r)]
    if unexpected:
        formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
        shown = "\n\n".join(formatter.format(r) for r in unexpected[:3])
        pytest.fail(f"{len(unexpected)} unexpected error record(s) logged:\n{shown}", pytrace=False)


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    assert GOLDEN.is_dir(), f"reference vectors not found at {GOLDEN}"
    return GOLDEN


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, golden_dir) -> Path:
    """The tiny CosyVoice2 directory of golden/, checkpoints rebuilt with the golden tools."""
    out = tmp_path_factory.mktemp("cv2_tiny")
    shutil.copy(golden_dir / "model_dir" / "cosyvoice2.yaml", out / "cosyvoice2.yaml")
    (out / "CosyVoice-BlankEN").mkdir()
    shutil.copy(golden_dir / "model_dir" / "CosyVoice-BlankEN" / "config.json", out / "CosyVoice-BlankEN")
    subprocess.run(
        [sys.executable, str(golden_dir / "make_model_dir.py"), str(out), "--from", str(golden_dir)],
        check=True,
        capture_output=True,
    )
    return out


# --- the tiny flow and its golden records (tests/test_cv2_flow*.py) ---------------------------------


@pytest.fixture(scope="module")
def flow(tiny_model_dir):
    from voicertc.backends.cosyvoice.flow.flow import CausalFlow

    return CausalFlow.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def golden(golden_dir):
    from safetensors.torch import load_file

    return load_file(golden_dir / "flow_nonstream.safetensors")


@pytest.fixture(scope="module")
def tts_golden(golden_dir):
    from safetensors.torch import load_file

    return load_file(golden_dir / "cv2_tts_tiny_flow_tiny_hift.safetensors")


# --- CosyVoice3: the tiny official-layout v3 directory and its golden records (tests/test_cv3_*.py) --


@pytest.fixture(scope="session")
def cv3_golden_dir(golden_dir) -> Path:
    path = golden_dir / "cv3"
    assert path.is_dir(), f"CosyVoice3 reference vectors not found at {path}"
    return path


@pytest.fixture(scope="session")
def tiny_cv3_model_dir(tmp_path_factory, cv3_golden_dir) -> Path:
    """The tiny CosyVoice3 directory of golden/cv3/, checkpoints rebuilt with the golden tools."""
    out = tmp_path_factory.mktemp("cv3_tiny")
    shutil.copy(cv3_golden_dir / "model_dir" / "cosyvoice3.yaml", out / "cosyvoice3.yaml")
    (out / "CosyVoice-BlankEN").mkdir()
    shutil.copy(cv3_golden_dir / "model_dir" / "CosyVoice-BlankEN" / "config.json", out / "CosyVoice-BlankEN")
    subprocess.run(
        [sys.executable, str(cv3_golden_dir / "make_model_dir.py"), str(out), "--from", str(cv3_golden_dir)],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def cv3_model(tiny_cv3_model_dir):
    """The tiny v3 model with the reference's HiFT noise buffers injected (hift_whole.safetensors)."""
    from safetensors.torch import load_file

    from voicertc.backends.cosyvoice3 import load

    model = load(tiny_cv3_model_dir)
    whole = load_file(GOLDEN / "cv3" / "hift_whole.safetensors")
    model.hift.set_noise(whole["buf_rand_ini"], whole["buf_sine_waves_prefix"])
    return model


@pytest.fixture(scope="session")
def cv3_records():
    """name -> the tensors of golden/cv3/<name> (loaded once per session)."""
    from safetensors.torch import load_file

    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = load_file(GOLDEN / "cv3" / name)
        return cache[name]

    return get
