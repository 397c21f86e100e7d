"""Sweeps: every combination of a grid of settings, teacher-forced on one text, paired with a baseline.

A grid is `KEY=v1,v2,...` entries (knobs of engine/knobs.py, and `CACHE`,
the RAM slots per layer); its rows are their Cartesian product, in the
order given. Each row is one teacher-forced run of the reference, exactly
as `tierlab eval --ppl` runs it (`evaluate.teacher_forced_run` on a cold
engine), on an engine of its own opened with the row's settings, so no row
inherits another's cache, heat or router state. Every distinct cache size
gets a baseline row too (every knob at its default, the same cache), and
each row is paired with its baseline token by token: Δ NLL with a paired
bootstrap 95% interval, top-1 agreement, KL(baseline ‖ row) of the
next-token distribution (mean, p50, p99) and high-confidence flips (the
baseline's top-1 had p > 0.5 and the row's top-1 differs), the keys the
quality gates judge (`dnll_hi`, `agree`, `kl_p99`, `flips`).

Rows run on a local process pool (spawned workers; each opens its own
engines) or on Ray; the baselines run first, their next-token log
probabilities go to the rows that pair with them (a file for the pool, the
object store for Ray). A row is a pure function of the model, the text and
its settings, so rows are the same however they ran. Finished rows are
appended to a results file one line at a time, so an interrupted sweep
keeps them and `resume` skips them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from tierlab.app.lab import paired
from tierlab.app.lab.evaluate import teacher_forced_run
from tierlab.app.lab.paired import Trace
from tierlab.engine.errors import TierlabError
from tierlab.engine.fingerprint import model_fingerprint
from tierlab.engine.knobs import SPEC_BY_NAME, KnobError, Knobs, parse_value
from tierlab.engine.options import EngineOptions
from tierlab.engine.tiering import TierOptions

CACHE_KEY = "CACHE"
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20241200  # fixed: a row's interval is the same on every run and machine
RESULTS_FORMAT = "tierlab-sweep-row"


# --- the grid ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSettings:
    """One row: knob values as canonical strings, and the RAM slots per layer."""

    knobs: tuple[tuple[str, str], ...]
    cache: int

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.knobs) or "off"

    @property
    def is_baseline(self) -> bool:
        return not self.knobs

    def key(self) -> str:
        return json.dumps({"knobs": dict(self.knobs), "cache": self.cache}, sort_keys=True)


def _canonical(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def parse_grid(entries: Iterable[str], n_experts: int) -> list[tuple[str, list[str]]]:
    """`KEY=v1,v2` entries as (key, canonical values); every value checked as the knob (or CACHE) checks it."""
    grid: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for entry in entries:
        key, sep, raw = entry.partition("=")
        key = key.strip()
        if not sep or not raw.strip():
            raise TierlabError(f"--grid {entry!r}: expected KEY=v1,v2,...")
        if key in seen:
            raise TierlabError(f"--grid {entry!r}: {key} is given twice")
        if key != CACHE_KEY and key not in SPEC_BY_NAME:
            raise TierlabError(f"--grid {entry!r}: unknown knob {key} (knobs: {', '.join(SPEC_BY_NAME)}, {CACHE_KEY})")
        values: list[str] = []
        for word in raw.split(","):
            word = word.strip()
            if key == CACHE_KEY:
                values.append(str(check_cache(word, n_experts, f"--grid {key}")))
            else:
                try:
                    values.append(_canonical(parse_value(SPEC_BY_NAME[key], word)))
                except KnobError as exc:
                    raise TierlabError(f"--grid {key}: {exc}") from None
        seen.add(key)
        grid.append((key, list(dict.fromkeys(values))))
    return grid


def check_cache(raw: object, n_experts: int, what: str) -> int:
    try:
        slots = int(str(raw).strip())
    except ValueError:
        raise TierlabError(f"{what}: {raw!r} is not a whole number of slots") from None
    if not 1 <= slots <= n_experts:
        raise TierlabError(f"{what}: {slots} slots per layer is outside 1..{n_experts} (the model's experts)")
    return slots


def grid_rows(grid: list[tuple[str, list[str]]], default_cache: int) -> list[RowSettings]:
    """The grid's combinations in order (the last key varies fastest); a row equal to the
    baseline (all knobs at their defaults) has no knobs and is that cache's baseline."""
    keys = [k for k, _ in grid]
    rows: list[RowSettings] = []
    for combo in itertools.product(*[values for _, values in grid]):
        cache = default_cache
        knobs = []
        for key, value in zip(keys, combo):
            if key == CACHE_KEY:
                cache = int(value)
            elif _canonical(parse_value(SPEC_BY_NAME[key], value)) != _canonical(SPEC_BY_NAME[key].default):
                knobs.append((key, value))
        row = RowSettings(tuple(knobs), cache)
        if row not in rows:
            rows.append(row)
    return rows


def with_baselines(rows: list[RowSettings]) -> list[RowSettings]:
    """Each cache size's baseline, ahead of that cache's first row; then the rows."""
    out: list[RowSettings] = []
    for row in rows:
        base = RowSettings((), row.cache)
        if base not in out:
            out.append(base)
        if row not in out:
            out.append(row)
    return out


# --- one row ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepJob:
    """Everything a worker needs for one row (picklable: it crosses into spawned processes and Ray)."""

    model: str
    prompt: tuple[int, ...]
    full: tuple[int, ...]
    settings: RowSettings


def open_row_engine(model: str | Path, settings: RowSettings):
    """A fresh engine with the row's cache and knobs (defaults elsewhere, the environment ignored)."""
    knobs = dict(settings.knobs)
    options = EngineOptions(Path(model), settings.cache, TierOptions(), knobs=knobs, knobs_from_env=False)
    return options.open(with_tokenizer=False)


@dataclass
class TeacherForced:
    """A row's own run: TF-NLL, its meters (RunMeters.summary) and the next-token log probabilities."""

    nll: float
    meters: dict
    log_probs: np.ndarray  # [tokens, vocab] float64, row t predicts full[len(prompt) + t]


def teacher_force(job: SweepJob) -> TeacherForced:
    log_probs: list[np.ndarray] = []
    engine = open_row_engine(job.model, job.settings)
    try:
        engine.cold_start()
        nll, meters = teacher_forced_run(engine, list(job.prompt), list(job.full),
                                         on_logits=lambda t, logits: log_probs.append(paired.log_softmax(logits)))
    finally:
        engine.close()
    return TeacherForced(nll, meters, np.stack(log_probs))


def token_nll(log_probs: np.ndarray, prompt_len: int, full: tuple[int, ...]) -> np.ndarray:
    targets = np.asarray(full[prompt_len:], dtype=np.int64)
    return -log_probs[np.arange(len(targets)), targets]


def paired_metrics(row: np.ndarray, base: np.ndarray, prompt_len: int, full: tuple[int, ...]) -> dict:
    """The row against its baseline, token by token (both [tokens, vocab] log probabilities), by the
    pairing `replay` and `ab` use (app/lab/paired.py)."""
    def trace(log_probs: np.ndarray) -> Trace:
        nll = token_nll(log_probs, prompt_len, full)
        return Trace(log_probs, nll, log_probs.argmax(axis=1), float(nll.mean()) if nll.size else math.nan)

    figures = paired.paired_metrics(trace(base), trace(row), seed=BOOTSTRAP_SEED, resamples=BOOTSTRAP_RESAMPLES)
    keys = ("dnll", "dnll_lo", "dnll_hi", "agree", "kl_mean", "kl_p50", "kl_p99", "flips")
    return {**{k: figures[k] for k in keys}, "flip_count": figures["flips_n"]}


ROW_METERS = ("ram_hit", "shadow_hit", "oracle_hit", "swap", "route_agree", "route_kl", "lru_half", "lru_1x",
              "lru_2x", "lru_4x", "lru_all_but_one")


def row_record(job: SweepJob, run: TeacherForced, base_log_probs: np.ndarray | None, base_nll: float | None,
               base_hit: float | None) -> dict:
    """The row as the table, JSON and the results file hold it (rates as fractions)."""
    meters = run.meters
    record = {
        "row": job.settings.label, "knobs": dict(job.settings.knobs), "cache": job.settings.cache,
        "baseline": job.settings.is_baseline, "tokens": len(job.full) - len(job.prompt),
        "tf_nll": run.nll, "ppl": math.exp(run.nll),
        **{key: meters.get(key) for key in ROW_METERS},
        "ram_hits": meters.get("ram_hits"), "ram_misses": meters.get("ram_misses"),
        "lru_sizes": meters.get("lru_sizes"),
    }
    if dict(job.settings.knobs).get("CACHE_ROUTE") != "1":
        record["swap"] = None
    if not Knobs.from_env(dict(job.settings.knobs)).snapshot().meters_on:
        record["route_agree"] = record["route_kl"] = None
    if base_log_probs is None:  # the baseline itself
        base_log_probs, base_nll, base_hit = run.log_probs, run.nll, meters.get("ram_hit")
    record.update(paired_metrics(run.log_probs, base_log_probs, len(job.prompt), job.full))
    record["dppl_pct"] = 100.0 * (math.exp(run.nll - base_nll) - 1.0)
    record["miss_reduction"] = miss_reduction(meters.get("ram_hit"), base_hit)
    return record


def miss_reduction(hit: float | None, base_hit: float | None) -> float | None:
    """1 − misses / baseline misses (a fraction; None when the baseline never missed)."""
    if hit is None or base_hit is None or base_hit >= 1.0:
        return None
    return 1.0 - (1.0 - hit) / (1.0 - base_hit)


# --- workers ------------------------------------------------------------------------------------------


def run_baseline(job: SweepJob, store: str | None) -> tuple[dict, object]:
    """A baseline row; its log probabilities go to `store` (a .npy path) or come back (Ray puts them)."""
    run = teacher_force(job)
    record = row_record(job, run, None, None, None)
    record["_base"] = {"nll": run.nll, "hit": run.meters.get("ram_hit")}
    if store is not None:
        np.save(store, run.log_probs)
        return record, store
    return record, run.log_probs


def run_paired(job: SweepJob, base: object, base_nll: float, base_hit: float | None) -> dict:
    """A row paired with its baseline (`base`: a .npy path, or the array itself)."""
    run = teacher_force(job)
    base_log_probs = np.load(base, mmap_mode="r") if isinstance(base, str) else np.asarray(base)
    return row_record(job, run, np.asarray(base_log_probs), base_nll, base_hit)


def _pool_baseline(job: SweepJob, store: str) -> dict:
    return run_baseline(job, store)[0]


def _worker_start() -> None:
    """Ctrl+C reaches the whole process group: the command handles it; workers only stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


# --- the results file -----------------------------------------------------------------------------------


def reference_digest(prompt: list[int], full: list[int]) -> str:
    return hashlib.sha256(json.dumps([len(prompt), list(full)]).encode()).hexdigest()[:16]


def model_identity(model: str | Path) -> str:
    """The model fingerprint (engine/fingerprint.py): a resumed sweep must be of the same weights' index."""
    return model_fingerprint(model)


class ResultsFile:
    """`--out sweep.jsonl`: one JSON line per finished row, appended with one write each."""

    def __init__(self, path: str | Path, identity: dict) -> None:
        self.path = Path(path)
        self.identity = identity

    def done(self) -> dict[str, dict]:
        """Rows already in the file for this model and text, by settings key (a torn last line is ignored)."""
        if not self.path.exists():
            return {}
        out: dict[str, dict] = {}
        try:
            lines = self.path.read_bytes().split(b"\n")
        except OSError as exc:
            raise TierlabError(f"--out {self.path}: cannot read: {exc.strerror}") from None
        for raw in lines:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(rec, dict) or rec.get("format") != RESULTS_FORMAT:
                continue
            if all(rec.get(k) == v for k, v in self.identity.items() if v is not None):
                out[rec["key"]] = rec["row"]
        return out

    def append(self, settings: RowSettings, row: dict) -> None:
        line = json.dumps({"format": RESULTS_FORMAT, **self.identity, "key": settings.key(), "row": row},
                          default=_plain) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise TierlabError(f"--out {self.path}: cannot write: {exc.strerror}") from None


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(type(value))


# --- the sweep ------------------------------------------------------------------------------------------


@dataclass
class SweepResult:
    rows: list[dict] = field(default_factory=list)  # in grid order, baselines included
    resumed: int = 0
    wall_s: float = 0.0
    runner: str = "serial"


def run_sweep(model: str | Path, prompt: list[int], full: list[int], rows: list[RowSettings], workers: int = 1,
              ray_address: str | None = None, out: str | Path | None = None, resume: bool = False,
              progress: Callable[[str], None] = lambda s: None, ray_cpus: int | None = None,
              ray_timeout_s: float = 15.0) -> SweepResult:
    """Run every row (baselines added) on `workers` processes, or on Ray at `ray_address`."""
    t0 = time.perf_counter()
    model = str(model)
    ordered = with_baselines(rows)
    identity = {"model": str(Path(model).resolve()), "fingerprint": model_identity(model),
                "reference": reference_digest(prompt, full)}
    results = ResultsFile(out, identity) if out else None
    if results is not None and not resume and results.path.exists():
        raise TierlabError(f"--out {results.path}: already exists (add --resume to continue it, or remove it)")
    done = results.done() if (results is not None and resume) else {}
    finished: dict[RowSettings, dict] = {s: done[s.key()] for s in ordered if s.key() in done}
    todo = [s for s in ordered if s not in finished]
    job = lambda s: SweepJob(model, tuple(prompt), tuple(full), s)  # noqa: E731

    def keep(settings: RowSettings, row: dict) -> None:
        row.pop("_base", None)
        finished[settings] = row
        if results is not None:
            results.append(settings, row)
        progress(f"done {len(finished)}/{len(ordered)}: {settings.label} (CACHE={settings.cache})")

    # baselines whose rows still need them must run (again, when resumed) for their log probabilities
    caches_needed = {s.cache for s in todo if not s.is_baseline}
    bases = [s for s in ordered if s.is_baseline and (s in todo or s.cache in caches_needed)]
    if todo:
        if ray_address:
            runner = "ray"
            _sweep_ray(ray_address, job, bases, todo, finished, keep, ray_cpus, ray_timeout_s)
        else:
            runner = "serial" if workers <= 1 else f"pool of {workers}"
            _sweep_local(workers, job, bases, todo, finished, keep)
    else:
        runner = "resumed"
    resumed = sum(1 for s in ordered if s.key() in done)
    return SweepResult([finished[s] for s in ordered], resumed, time.perf_counter() - t0, runner)


def _sweep_local(workers, job, bases, todo, finished, keep) -> None:
    with tempfile.TemporaryDirectory(prefix="tierlab-sweep-") as tmp:
        store = {s.cache: os.path.join(tmp, f"base-{s.cache}.npy") for s in bases}
        base_stats: dict[int, tuple[float, float | None]] = {}
        if workers <= 1:
            for s in bases:
                record = _pool_baseline(job(s), store[s.cache])
                base_stats[s.cache] = (record["_base"]["nll"], record["_base"]["hit"])
                if s in todo:
                    keep(s, record)
            for s in todo:
                if not s.is_baseline:
                    keep(s, run_paired(job(s), store[s.cache], *base_stats[s.cache]))
            return
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_worker_start)
        interrupted = True
        try:
            pending = {pool.submit(_pool_baseline, job(s), store[s.cache]): s for s in bases}
            rows = [s for s in todo if not s.is_baseline]
            while pending:
                ready, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in ready:
                    s = pending.pop(fut)
                    record = fut.result()
                    if s.is_baseline:
                        base_stats[s.cache] = (record["_base"]["nll"], record["_base"]["hit"])
                        if s in todo:
                            keep(s, record)
                        for r in [r for r in rows if r.cache == s.cache]:
                            pending[pool.submit(run_paired, job(r), store[r.cache], *base_stats[r.cache])] = r
                    else:
                        keep(s, record)
            interrupted = False
        finally:
            # interrupted: rows not started are dropped and running ones are not waited for
            pool.shutdown(wait=not interrupted, cancel_futures=True)


def _sweep_ray(address, job, bases, todo, finished, keep, cpus, timeout_s) -> None:
    try:
        import ray
    except ImportError:
        raise TierlabError("--ray: Ray is not installed (pip install 'tierlab[ray]')") from None
    started_here = not ray.is_initialized()
    if started_here:
        init_ray(ray, address, cpus, timeout_s)
    try:
        baseline_task = ray.remote(num_cpus=1)(run_baseline)
        paired_task = ray.remote(num_cpus=1)(run_paired)
        pending = {baseline_task.remote(job(s), None): s for s in bases}
        rows = [s for s in todo if not s.is_baseline]
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                s = pending.pop(ref)
                if s.is_baseline:
                    record, log_probs = ray.get(ref)
                    base_ref = ray.put(log_probs)
                    stats = (record["_base"]["nll"], record["_base"]["hit"])
                    if s in todo:
                        keep(s, record)
                    for r in [r for r in rows if r.cache == s.cache]:
                        pending[paired_task.remote(job(r), base_ref, *stats)] = r
                else:
                    keep(s, ray.get(ref))
    finally:
        if started_here:
            ray.shutdown()


def init_ray(ray, address: str, cpus: int | None, timeout_s: float) -> None:
    """`local` starts a Ray instance on this machine; any other address must answer within timeout_s."""
    import tierlab

    runtime = {"env_vars": {"PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(tierlab.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p)}}
    try:
        if address == "local":
            ray.init(num_cpus=cpus or os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                     runtime_env=runtime, logging_level="ERROR")
        else:
            _check_reachable(address, timeout_s)
            ray.init(address=address, log_to_driver=False, runtime_env=runtime, logging_level="ERROR")
    except TierlabError:
        raise
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError for a bad address
        raise TierlabError(f"--ray {address}: cannot connect: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def _check_reachable(address: str, timeout_s: float) -> None:
    """A host:port (or ray://host:port) must accept a TCP connection within timeout_s; Ray itself
    would keep retrying for a minute."""
    import socket

    target = address.split("://", 1)[-1]
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise TierlabError(f"--ray {address}: expected local, HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise TierlabError(f"--ray {address}: unreachable ({exc.strerror or exc})") from None
