"""Regenerate the dashboard screenshots in ``docs/`` and their block in ``README.md`` from a real run.

Starts a mosquitto on 127.0.0.1 (the demo's embedded broker when mosquitto is not installed), runs
``edgefl demo`` against it (real agent processes, each serving its device page, and the coordinator
serving the fleet page), waits until round ``--at-round`` has closed (the demo's rounds are quick: the
job may be further on), and photographs the pages in
Debian's Chromium driven by playwright:

- ``docs/dashboard-coordinator.png``: the fleet page at 1366x900, the whole page;
- ``docs/dashboard-device.png``: the first device's page at 1366x900, the whole page;
- ``docs/dashboard-coordinator-phone.png`` and ``docs/dashboard-device-phone.png``: both at 390x844,
  the first screen.

The block between ``<!-- screenshots:begin -->`` and ``<!-- screenshots:end -->`` in ``README.md`` is
rewritten with the pictures and the run they come from (date, devices, the round the pages show).

Run: ``.venv/bin/python -m bench.screenshots`` (``--devices 4 --rounds 40 --at-round 25``; about a
minute). Nothing is written when the run fails.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WIDE = {"width": 1366, "height": 900}
PHONE = {"width": 390, "height": 844}
BEGIN, END = "<!-- screenshots:begin -->", "<!-- screenshots:end -->"
URL_LINE = re.compile(r"^\s*(coordinator|dev-\d+) dashboard: (http://\S+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_mosquitto(work: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    """A mosquitto on a free loopback port, or None when it is not installed."""
    exe = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if exe is None:
        return None
    port = _free_port()
    conf = work / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    log = open(work / "mosquitto.log", "wb")  # noqa: SIM115 - lives as long as the broker
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=log)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"mqtt://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("mosquitto did not start listening within 10 s")


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "api/status", timeout=5) as r:
        doc: dict[str, Any] = json.loads(r.read())["status"]
        return doc


def _shoot(url: str, path: Path, viewport: dict[str, int], *, full_page: bool, settle_s: float) -> str:
    """Photograph the page at ``url``; return the round it showed."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport=viewport).new_page()  # type: ignore[arg-type]
            page.goto(url)
            expect(page.locator("#live")).to_have_text("live", timeout=10_000)
            time.sleep(settle_s)  # a few pushes: the charts gather points
            page.screenshot(path=str(path), full_page=full_page)
            return page.text_content("#round") or "?"
        finally:
            browser.close()


def _readme_block(devices: int, at_round: str, rounds: int, broker: str) -> str:
    day = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return (
        f"{BEGIN}\n"
        "| fleet page | device page |\n"
        "|---|---|\n"
        "| ![fleet page](docs/dashboard-coordinator.png) | ![device page](docs/dashboard-device.png) |\n"
        "| ![fleet page on a phone](docs/dashboard-coordinator-phone.png) "
        "| ![device page on a phone](docs/dashboard-device-phone.png) |\n\n"
        f"Taken by `python -m bench.screenshots` on {day} from a real run: `edgefl demo` with {devices} "
        f"agent processes on {broker}, round {at_round} of {rounds}, Debian's Chromium at 1366x900 "
        "and 390x844.\n"
        f"{END}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the demo, photograph its pages and write them to ``docs/`` (and the README's block).

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments (``--devices``, ``--rounds``, ``--at-round``, ``--no-readme``).

    Returns
    -------
    int
        0 once the pictures are written.

    Raises
    ------
    RuntimeError
        If the demo prints no dashboard URLs, round ``--at-round`` never closes, or a picture is not
        a PNG (nothing is written then).
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4, help="agent processes (default 4)")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of the job (default 40)")
    ap.add_argument("--at-round", type=int, default=25, help="photograph once this round closed (default 25)")
    ap.add_argument("--no-readme", action="store_true", help="leave README.md as it is")
    args = ap.parse_args(argv)
    if not 1 <= args.at_round < args.rounds:
        ap.error("--at-round must be at least 1 and below --rounds")

    with tempfile.TemporaryDirectory(prefix="edgefl-shots-") as tmp:
        work = Path(tmp)
        broker = _start_mosquitto(work)
        cmd = [
            sys.executable,
            "-m",
            "edgefl.cli",
            "demo",
            "--devices",
            str(args.devices),
            "--rounds",
            str(args.rounds),
            "--hold",
            "60",
            "--workdir",
            str(work / "demo"),
        ]
        if broker is not None:
            cmd += ["--broker", broker[1]]
        out = work / "demo.out"
        with open(out, "wb") as sink:
            demo = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            urls: dict[str, str] = {}
            deadline = time.monotonic() + 300
            while "coordinator" not in urls or "dev-1" not in urls:
                if demo.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "the demo printed no dashboard URLs:\n" + out.read_text(errors="replace")
                    )
                for line in out.read_text(errors="replace").splitlines():
                    found = URL_LINE.match(line)
                    if found:
                        urls[found.group(1)] = found.group(2)
                time.sleep(0.2)
            fleet = urls["coordinator"]
            while True:
                rounds = _status(fleet).get("rounds") or []
                if rounds and rounds[-1].get("round", 0) >= args.at_round:
                    break
                if demo.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"round {args.at_round} never closed:\n" + out.read_text(errors="replace")
                    )
                time.sleep(0.2)
            shots = work / "shots"
            shots.mkdir()
            at_round = _shoot(fleet, shots / "dashboard-coordinator.png", WIDE, full_page=True, settle_s=3.0)
            _shoot(urls["dev-1"], shots / "dashboard-device.png", WIDE, full_page=True, settle_s=3.0)
            _shoot(fleet, shots / "dashboard-coordinator-phone.png", PHONE, full_page=False, settle_s=1.0)
            _shoot(urls["dev-1"], shots / "dashboard-device-phone.png", PHONE, full_page=False, settle_s=1.0)
        finally:
            if demo.poll() is None:
                demo.send_signal(signal.SIGINT)
                try:
                    demo.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    demo.kill()
                    demo.wait()
            if broker is not None:
                broker[0].terminate()
                broker[0].wait(timeout=10)
        for png in sorted(shots.iterdir()):
            if png.read_bytes()[:8] != base64.b64decode("iVBORw0KGgo="):
                raise RuntimeError(f"{png.name}: not a PNG")
            shutil.copyfile(png, DOCS / png.name)
            print(f"wrote docs/{png.name} ({png.stat().st_size // 1024} KiB)")
    if not args.no_readme:
        readme = ROOT / "README.md"
        text = readme.read_text()
        block = _readme_block(
            args.devices,
            at_round,
            args.rounds,
            "a local mosquitto" if broker is not None else "the embedded broker",
        )
        if BEGIN in text and END in text:
            text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
            readme.write_text(text)
            print("README.md: screenshots block rewritten")
        else:
            print(f"README.md has no {BEGIN} ... {END} block: left as it is")
    return 0


if __name__ == "__main__":
    sys.exit(main())
