"""Build the documentation site and photograph pages of it in headless Chromium, as a reader sees them.

    python tools/docs_screenshots.py [--out docs/screenshots] [--page index.html --page results/benchmarks/index.html]

The site is served from 127.0.0.1 on a free port for the duration (file:// would skip what a server does:
directory URLs, the search index). Needs Chromium: ``apt-get install chromium-headless-shell`` (or
``chromium``). Writes one PNG per page; look at them before saying the site works.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
DEFAULT_PAGES = ("index.html", "results/benchmarks/index.html")


def find_browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit(f"no Chromium found (looked for {', '.join(BROWSERS)}): apt-get install chromium-headless-shell")


def build_site(out: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    subprocess.run([str(mkdocs), "build", "--strict", "-q", "-f", str(REPO / "mkdocs.yml"), "-d", str(out)], check=True)


def screenshot(browser: str, url: str, png: Path, width: int, height: int) -> None:
    command = [
        browser,
        "--headless",
        "--no-sandbox",  # root in a container has no user namespace for the sandbox
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        f"--screenshot={png}",
        url,
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    if not png.exists() or png.stat().st_size == 0:
        raise SystemExit(f"Chromium wrote no screenshot of {url}")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # one line per file fetched is noise here
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    parser.add_argument("--page", action="append", help=f"site path to photograph (default: {DEFAULT_PAGES})")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=1600)
    args = parser.parse_args(argv)
    browser = find_browser()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as site:
        build_site(Path(site))
        handler = functools.partial(QuietHandler, directory=site)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            for page in args.page or DEFAULT_PAGES:
                name = page.removesuffix("index.html").strip("/").replace("/", "_") or "home"
                png = args.out / f"{name}.png"
                screenshot(browser, f"http://127.0.0.1:{server.server_port}/{page}", png, args.width, args.height)
                print(f"wrote {png}")
        finally:
            server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
